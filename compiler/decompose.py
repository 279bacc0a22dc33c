"""What tracing decomposes, and what it keeps: the core-ATen decompositions plus ours, minus the
fused kernels that have sharding rules.

Ours rewrite three ops so a split survives them: ``mean`` as sum / global count (a split reduction dim
still divides by the global size), ``addmm`` as mm + add (a split contraction leaves a pending sum the
bias does not join; the add is marked so the per-rank program fuses it back), and layer norm's
backward as the fused kernel for the input's gradient plus two sums (pending on a split batch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx.traceback as fxt
from torch._decomp import core_aten_decompositions

aten = torch.ops.aten


_HALF = (torch.float16, torch.bfloat16)


def _mean(x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> torch.Tensor:
    """mean as sum / global count, so a split reduction dim still divides by the global size.
    A half-precision mean sums and divides in fp32 and rounds once, as torch's kernel does (a
    half-precision sum of a million 0.1s overflows fp16)."""
    dims = list(range(x.dim())) if dim in (None, []) or x.dim() == 0 else [d % x.dim() for d in dim]
    count = 1
    for d in dims:
        count *= x.shape[d]
    out = dtype if dtype is not None else x.dtype
    if out in _HALF:
        return (torch.sum(x, dims, keepdim, dtype=torch.float32) / count).to(out)
    return torch.sum(x, dims, keepdim, dtype=dtype) / count


def _addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    """addmm as mm + add, so a split contraction dim leaves a pending sum the bias does not join.
    The add is marked (``is_addmm_add``) so the per-rank program fuses it back into one addmm, and
    only it: a hand-written ``x @ w + b`` rounds the product before the add, as eager does."""
    out = torch.mm(a, b)
    out = out * alpha if alpha != 1 else out
    if beta == 0:  # torch ignores the input then: its nan and inf must not reach the result
        return out
    bias = bias * beta if beta != 1 else bias
    with fxt.annotate({ADDMM_MARK: True}):
        return out + bias


ADDMM_MARK = "shardspec_addmm"


def is_addmm_add(node: torch.fx.Node) -> bool:
    """Whether ``node`` is the add of an addmm (or linear) the user called, split by ``_addmm``.
    The mark lives in ``node.meta["custom"]``, which tracing copies onto the nodes an op becomes
    (the functionalize replay included)."""
    return bool(node.meta.get("custom", {}).get(ADDMM_MARK))


def _layer_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_mask: Sequence[bool],
) -> Any:
    """native_layer_norm_backward as the fused kernel for the input's gradient alone plus two sums.

    The input's gradient keeps the leading (batch) dims, the weight and bias gradients sum over them:
    one rule cannot say both, so a split batch would have to be gathered. Asking the kernel for the
    input's gradient only (traced as one node, with a rule) and summing ``grad * x_hat`` and ``grad``
    over the leading dims (pending sums on a split batch) keeps the fused kernel and the split."""
    if list(output_mask) == [True, False, False]:
        return NotImplemented  # traced as the fused op itself
    lead = list(range(x.dim() - len(normalized_shape)))
    grad_input = (
        aten.native_layer_norm_backward(
            grad_out, x, normalized_shape, mean, rstd, weight, bias, [True, False, False]
        )[0]
        if output_mask[0]
        else None
    )
    wide = torch.float32 if grad_out.dtype in (torch.float16, torch.bfloat16) else grad_out.dtype

    def total(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        t = t.to(wide)
        return (torch.sum(t, lead) if lead else t).to(like.dtype)

    grad_weight = (
        total(grad_out * ((x - mean) * rstd), weight) if output_mask[1] and weight is not None else None
    )
    grad_bias = total(grad_out, bias) if output_mask[2] and bias is not None else None
    return grad_input, grad_weight, grad_bias


_EXTRA_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.mean.dim: _mean,
    aten.mean.default: lambda x, *, dtype=None: _mean(x, dtype=dtype),
    aten.addmm.default: _addmm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
}

# Fused kernels kept as one node: each has a rule (compiler/rules), so decomposing it would only
# replace one kernel by a chain of elementwise ops the per-rank program then runs one by one.
KEPT_FUSED: tuple[Any, ...] = (
    aten.gelu_backward.default,
    aten.tanh_backward.default,
    aten.sigmoid_backward.default,
    aten.silu_backward.default,
    aten.threshold_backward.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    # elementwise kernels with rules: decomposed they round differently from eager (SiLU, Llama's
    # activation, in a quarter of its elements) and run as several ops
    aten.silu.default,
    aten.mish.default,
    aten.softplus.default,
    aten.lerp.Scalar,
    aten.lerp.Tensor,
    aten.logaddexp.default,
    aten.xlogy.Tensor,
)
# Views the rules take as they are: decomposing each into a permute or squeeze.dims doubles its
# tracing work (the decomposition is traced as an op of its own). Rewritten before a functionalize
# replay (``views_as_permutes``).
KEPT_VIEWS: tuple[Any, ...] = (aten.transpose.int, aten.t.default, aten.squeeze.dim)
# Kept as one multi-output view (it has a rule) rather than one ``select`` per piece.
KEPT_MULTI_VIEWS: tuple[Any, ...] = (aten.unbind.int,)


@functools.cache
def decompositions() -> dict[Any, Callable[..., Any]]:
    """Core-ATen decompositions plus ours, minus the fused kernels that have rules and the views in
    KEPT_VIEWS and KEPT_MULTI_VIEWS (built once: collecting torch's table walks every op's overloads)."""
    table = cast(dict[Any, Callable[..., Any]], dict(core_aten_decompositions()))
    for op in (*KEPT_FUSED, *KEPT_VIEWS, *KEPT_MULTI_VIEWS):
        table.pop(op, None)
    table.update(_EXTRA_DECOMPOSITIONS)
    return table


def views_as_permutes(graph: torch.fx.Graph) -> None:
    """Rewrite the KEPT_VIEWS nodes as the ``permute`` and ``squeeze.dims`` they decompose to.
    Functionalize replays a ``t`` or ``transpose`` as a view plus a contiguous clone, which the
    kernel after it then reads in another memory order than eager's (matmuls round differently)."""
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in KEPT_VIEWS:
            continue
        x = n.args[0]
        rank = n.args[0].meta["val"].dim()
        if n.target is aten.squeeze.dim:
            n.target, n.args = aten.squeeze.dims, (x, [n.args[1]])
            continue
        order = list(range(rank))
        if n.target is aten.t.default:
            order.reverse()
        elif rank > 1:  # a transpose of a 0-d or 1-d tensor is the tensor itself
            a, b = (int(d) % rank for d in n.args[1:3])
            order[a], order[b] = order[b], order[a]
        n.target, n.args = aten.permute.default, (x, order)
