"""Layer norm's weight and bias gradients back into its fused backward kernel, per rank.

Why: tracing asks ``native_layer_norm_backward`` for the input's gradient alone and writes the weight
and bias gradients as ``sum(grad * (x - mean) * rstd)`` and ``sum(grad)`` over the leading dims
(``compiler/decompose.py``): one sharding rule cannot both keep and sum the batch, and the sums become
pending sums where the batch is split. Once partitioned, each rank's program computes exactly those
local sums, which the kernel computes in the same pass that gives the input's gradient, without the
three elementwise temporaries (five ops and three activation-sized buffers per layer norm). The
collectives that follow read the kernel's results as they read the sums.

Only float32/float64 gradients (half precision sums in float32 in the decomposition) and only the
exact pattern the decomposition writes are rewritten; anything else is left as it is.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import copy_module, val

aten = torch.ops.aten
_SEE_THROUGH = {aten.contiguous.default, aten.alias.default}


def norm_grads(gm: GraphModule) -> GraphModule:
    """Fuse each layer norm's weight/bias gradient sums into its backward kernel (module doc)."""
    gm = copy_module(gm)
    norm_grads_(gm)
    gm.recompile()
    return gm


def norm_grads_(gm: GraphModule) -> None:
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is aten.native_layer_norm_backward.default:
            _fuse(gm, n)
    gm.graph.lint()


def _source(n: object) -> object:
    while isinstance(n, Node) and n.op == "call_function" and n.target in _SEE_THROUGH:
        n = n.args[0]
    return n


def _call(n: object, target: object) -> Node | None:
    return n if isinstance(n, Node) and n.op == "call_function" and n.target is target else None


def _is_sum(n: Node, x: Node, lead: list[int]) -> bool:
    """``n`` is sum(x, lead) with nothing else asked (no keepdim, no dtype)."""
    return (
        _call(n, aten.sum.dim_IntList) is not None
        and n.args[0] is x
        and list(n.args[1]) == lead  # type: ignore[arg-type]
        and not (len(n.args) > 2 and n.args[2])
        and not n.kwargs.get("keepdim", False)
        and n.kwargs.get("dtype") is None
    )


def _fuse(gm: GraphModule, nlb: Node) -> None:
    grad, x, shape, mean, rstd, weight, bias, mask = (list(nlb.args) + [None] * 8)[:8]
    if (
        not isinstance(weight, Node)
        or not isinstance(mask, (list, tuple))
        or list(mask) != [True, False, False]
    ):
        return
    g, src_x, src_mean, src_rstd = _source(grad), _source(x), _source(mean), _source(rstd)
    xv = val(x)
    wide = (torch.float32, torch.float64)
    if not isinstance(g, Node) or not isinstance(xv, torch.Tensor) or xv.dtype not in wide:
        return
    lead = list(range(xv.dim() - len(shape)))  # type: ignore[arg-type]
    grad_weight = grad_bias = None
    for user in g.users:
        if _is_sum(user, g, lead):
            grad_bias = grad_bias or user
        mul = _call(user, aten.mul.Tensor)
        if mul is None or mul.args[0] is not g or len(mul.users) != 1:
            continue
        scaled = _call(mul.args[1], aten.mul.Tensor)
        centered = _call(scaled.args[0], aten.sub.Tensor) if scaled is not None else None
        if (
            scaled is None
            or centered is None
            or len(scaled.users) != 1
            or len(centered.users) != 1
            or _source(scaled.args[1]) is not src_rstd
            or _source(centered.args[0]) is not src_x
            or _source(centered.args[1]) is not src_mean
            or centered.kwargs.get("alpha", 1) != 1
            or len(centered.args) > 2
        ):
            continue
        (total,) = mul.users
        if _is_sum(total, mul, lead):
            grad_weight = total
    if grad_weight is None or (grad_bias is None) != (not isinstance(bias, Node)):
        return
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    if any(position[u] < position[nlb] for old in (grad_weight, grad_bias) if old for u in old.users):
        return  # a use before the kernel: the kernel's results would come too late
    nlb.args = (*nlb.args[:7], [True, True, grad_bias is not None])
    outs = list(nlb.meta.get("val") or (None, None, None))
    for k, old in ((1, grad_weight), (2, grad_bias)):
        if old is None:
            continue
        for stale in [u for u in nlb.users if u.target is operator.getitem and u.args[1] == k]:
            if not stale.users:
                gm.graph.erase_node(stale)
        with gm.graph.inserting_after(nlb):
            taken = gm.graph.call_function(operator.getitem, (nlb, k))
        taken.meta = dict(old.meta)
        outs[k] = old.meta.get("val")
        old.replace_all_uses_with(taken)
        _erase_chain(gm, old)
    if "val" in nlb.meta:
        nlb.meta["val"] = tuple(outs)


def _erase_chain(gm: GraphModule, n: Node) -> None:
    """``n`` and the inputs that only it read, back to the layer norm's own operands."""
    todo = [n]
    while todo:
        node = todo.pop()
        if node.users or node.op != "call_function" or node.target not in _CHAIN:
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        todo += inputs


_CHAIN = {aten.sum.dim_IntList, aten.mul.Tensor, aten.sub.Tensor}
