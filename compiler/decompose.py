"""What tracing decomposes, and what it keeps: the core-ATen decompositions plus ours, minus the
fused kernels that have sharding rules.

Ours rewrite three ops so a split survives them: ``mean`` as sum / global count (a split reduction dim
still divides by the global size), ``addmm`` as mm + add (a split contraction leaves a pending sum the
bias does not join; the add is marked so the per-rank program fuses it back), and layer norm's
backward as the fused kernel for the input's gradient plus two sums (pending on a split batch).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx.traceback as fxt
from torch._decomp import core_aten_decompositions

from compiler.sources import user_frame
from shardspec.errors import fail

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
    if not (out.is_floating_point or out.is_complex):  # torch's own check, with its error type
        which = "Optional dtype" if dtype is not None else "Input dtype"
        raise RuntimeError(
            f"mean(): could not infer output dtype. {which} must be either a floating point or "
            f"complex dtype. Got: {out}"
        )
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


def _batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> Any:
    """native_batch_norm in training writes its running statistics in place, though its schema does
    not say so: functionalization and the in-place checks would not see the write, and a rank
    holding a block of the statistics would write a copy that is thrown away. Traced as the fused
    kernel without running statistics (pure, with a rule) and their update as ops written back with
    ``copy_``, which functionalization turns into results (and the checks see)."""
    if not training or running_mean is None or running_var is None or not x.is_floating_point():
        return NotImplemented  # the fused op itself: it writes nothing, or raises as eager does
    out, save_mean, invstd = aten.native_batch_norm(x, weight, bias, None, None, True, momentum, eps)
    # eager's update takes the batch's mean and unbiased variance, in fp32 for half-precision input
    wide = torch.float32 if x.dtype in _HALF else x.dtype
    var, mean = torch.var_mean(x.to(wide), [0, *range(2, x.dim())], correction=1)
    running_mean.copy_(running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum)
    running_var.copy_(running_var * (1 - momentum) + var.to(running_var.dtype) * momentum)
    return out, save_mean, invstd


def _convolution_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    output_mask: Sequence[bool],
) -> Any:
    """convolution_backward as one kernel call per gradient asked for, and the bias's as a sum.

    The input's gradient keeps the batch and sums over output channels, the weight's the reverse:
    one rule cannot say both, so a split batch (data parallel) would be gathered, activations and
    all. Asked one at a time each call has a rule that keeps the split (the weight's gradient a
    pending sum over the batch, reduced as data parallel's gradient), as layer norm's backward."""
    if sum(bool(m) for m in output_mask) <= 1 and not output_mask[2]:
        return NotImplemented  # one gradient of input or weight: the fused op itself

    def one(k: int) -> torch.Tensor | None:
        if not output_mask[k]:
            return None
        mask = [i == k for i in range(3)]
        args = (stride, padding, dilation, transposed, output_padding, groups, mask)
        return cast(torch.Tensor, aten.convolution_backward(grad_out, x, weight, None, *args)[k])

    grad_bias = None
    if output_mask[2]:
        batched = grad_out.dim() == weight.dim()
        channel = 1 if batched else 0
        wide = torch.float32 if grad_out.dtype in _HALF else grad_out.dtype
        dims = [d for d in range(grad_out.dim()) if d != channel]
        grad_bias = torch.sum(grad_out.to(wide), dims).to(grad_out.dtype)
    return one(0), one(1), grad_bias


_EXTRA_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.native_batch_norm.default: _batch_norm,
    aten.convolution_backward.default: _convolution_backward,
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


def as_slices(
    shape: Sequence[int], size: Sequence[int], stride: Sequence[int], offset: int
) -> list[tuple[int, int, int, int]] | None:
    """``as_strided(x, size, stride, offset)`` of a contiguous ``x`` of ``shape`` (storage offset 0)
    as slices ``(dim, start, stop, step)`` of ``x`` followed by a reshape to ``size`` (which only
    drops or adds size-1 dims), or None when it is not one (a permuted or overlapping view).
    Checked on a meta tensor: the slices must give exactly ``stride`` and ``offset``."""
    contiguous = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        contiguous[i] = contiguous[i + 1] * max(int(shape[i + 1]), 1)
    starts, rest = [], int(offset)
    for n, c in zip(shape, contiguous, strict=True):
        starts.append(rest // c if n > 1 else 0)
        rest -= starts[-1] * c
    if rest or any(s >= max(int(n), 1) for s, n in zip(starts, shape, strict=True)):
        return None
    ops, dim = [], 0
    for n, t in zip(size, stride, strict=True):
        if n == 1:
            continue
        while dim < len(shape) and not (
            shape[dim] > 1
            and t > 0
            and t % contiguous[dim] == 0
            and starts[dim] + (n - 1) * (t // contiguous[dim]) < shape[dim]
        ):
            dim += 1
        if dim == len(shape):
            return None
        step = t // contiguous[dim]
        ops.append((dim, starts[dim], starts[dim] + (n - 1) * step + 1, step))
        dim += 1
    kept = {op[0] for op in ops}
    ops += [(d, starts[d], starts[d] + 1, 1) for d in range(len(shape)) if d not in kept and shape[d] > 1]
    view = torch.empty(tuple(shape), device="meta")
    for d, a, b, s in ops:
        view = view[(slice(None),) * d + (slice(a, b, s),)]
    view = view.reshape(tuple(size))
    same = all(n == 1 or v == t for n, v, t in zip(size, view.stride(), stride, strict=True))
    return ops if same and view.storage_offset() == offset and view.numel() == math.prod(size) else None


def _blocks(x: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int) -> Any:
    """(shape to view ``x`` as, slices) expressing ``as_strided``, or None. Autograd flattens the
    base of a view it writes through, so besides ``x``'s own shape try the shape the strides
    factor its elements into ((32,) with strides (4, 1): (8, 4))."""
    shapes = [tuple(x.shape)]
    dims, rest = [], x.numel()
    for t in sorted({int(t) for n, t in zip(size, stride, strict=True) if n > 1}, reverse=True):
        if t <= 0 or rest % t:
            break
        dims.append(rest // t)
        rest = t
    else:
        shapes.append((*dims, rest) if rest > 1 else tuple(dims))
    for shape in shapes:
        ops = as_slices(shape, size, stride, offset)
        if ops is not None:
            return shape, ops
    return None


def _own_storage(x: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int) -> None:
    """as_strided reads ``x``'s storage, not its values: the traced step, which works on values,
    can only follow it where that storage is ``x`` itself, laid out contiguously."""
    last = offset + sum((n - 1) * t for n, t in zip(size, stride, strict=True) if n > 0)
    if x.is_contiguous() and x.storage_offset() == 0 and (0 in size or 0 <= last < x.numel()):
        return
    raise fail(
        f"as_strided at {user_frame()} on a tensor of shape {tuple(x.shape)} with strides "
        f"{tuple(x.stride())} and storage offset {x.storage_offset()}, asking for size {tuple(size)}, "
        f"stride {tuple(stride)}, offset {offset}: it reads memory beyond that tensor's own contiguous "
        "elements (a transposed or sliced view's base), which a traced step, working on values, "
        "cannot follow.",
        "call .contiguous() on the tensor first (as_strided then reads its own elements), or express "
        "the view with slicing, unfold or reshape.",
    )


def _as_strided(
    x: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int | None = None
) -> Any:
    """as_strided of a contiguous tensor that is a slicing of it (autograd's backward of a slice
    assignment, circular padding's backward): those slices, which have rules, and a reshape."""
    _own_storage(x, size, stride, offset or 0)
    found = _blocks(x, size, stride, offset or 0)
    if found is None:
        return NotImplemented
    shape, ops = found
    x = aten.view.default(x, list(shape))
    for d, a, b, s in ops:
        x = aten.slice.Tensor(x, d, a, b, s)
    return aten.view.default(x, list(size))


def _as_strided_scatter(
    x: torch.Tensor, src: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset: int | None = None
) -> Any:
    """as_strided_scatter into a contiguous tensor where the region is a slicing of it: nested
    slice_scatters (each with a rule), innermost first."""
    _own_storage(x, size, stride, offset or 0)
    found = _blocks(x, size, stride, offset or 0)
    if found is None:
        return NotImplemented
    shape, ops = found
    views = [aten.view.default(x, list(shape))]
    for d, a, b, s in ops:
        views.append(aten.slice.Tensor(views[-1], d, a, b, s))
    out = aten.view.default(src, list(views[-1].shape))
    for (d, a, b, s), base in zip(reversed(ops), reversed(views[:-1]), strict=True):
        out = aten.slice_scatter.default(base, out, d, a, b, s)
    return aten.view.default(out, list(x.shape))


_EXTRA_DECOMPOSITIONS[aten.as_strided.default] = _as_strided
_EXTRA_DECOMPOSITIONS[aten.as_strided_scatter.default] = _as_strided_scatter
# a shape question (torch.func.jvp asks it of each tangent): answered at trace time from the global
# shapes, so no node asks it of a rank's block
_EXTRA_DECOMPOSITIONS[aten.is_same_size.default] = lambda a, b: tuple(a.shape) == tuple(b.shape)
_EXTRA_DECOMPOSITIONS[aten._has_same_storage_numel.default] = lambda a, b: (
    a.untyped_storage().nbytes() // a.element_size() == b.untyped_storage().nbytes() // b.element_size()
)


def _foreach(target: Any, base: Any, inplace: bool) -> Callable[..., Any]:
    """``_foreach_<op>`` as ``<op>`` per tensor: each list argument (tensors or numbers) indexed,
    every other argument passed whole; an argument ``<op>`` takes by keyword only (addcmul's
    ``value``, which the foreach form takes as its ``scalars``; the norm's ``dtype``) by that name.
    One node per tensor, each with its op's rule (the fused multi-tensor kernel has none, and its
    tensors may lie in different layouts)."""
    schemas = [getattr(base, o)._schema for o in base.overloads()]
    positional = max(len([a for a in sc.arguments if not a.kwarg_only]) for sc in schemas)
    keyword = sorted({a.name for sc in schemas for a in sc.arguments if a.kwarg_only and a.name != "out"})
    plan: list[str | None] = []  # per foreach argument: None (positional) or the keyword to pass it by
    for i, a in enumerate(target._schema.arguments):
        if a.name in keyword:
            plan.append(a.name)
        elif i < positional:
            plan.append(None)
        else:
            plan.append(keyword[0] if len(keyword) == 1 else a.name)
    # maximum and minimum take no Scalar: the number as a 0-dim tensor of the type eager's
    # promotion gives (an int tensor with 2.5: a float)
    scalar_as_tensor = base.__name__.rstrip("_") in ("maximum", "minimum")

    def pick(a: Any, j: int) -> Any:
        return a[j] if isinstance(a, (list, tuple)) else a

    def run(*args: Any, **kwargs: Any) -> Any:
        pos = [a for a, k in zip(args, plan, strict=False) if k is None]
        named = {k: a for a, k in zip(args, plan, strict=False) if k is not None} | kwargs
        count = next(len(a) for a in [*pos, *named.values()] if isinstance(a, (list, tuple)))
        out = []
        for j in range(count):
            call = [pick(a, j) for a in pos]
            if scalar_as_tensor and not isinstance(call[1], torch.Tensor):
                kind = torch.result_type(call[0], call[1])
                call[1] = torch.scalar_tensor(call[1], dtype=kind, device=call[0].device)
            kw = {k: pick(v, j) for k, v in named.items()}
            if isinstance(kw.get("value"), torch.Tensor) and len(call) == 3:  # addcmul/addcdiv.Tensor
                value = kw.pop("value")
                out.append(_addc_tensor(base, call, value[j] if value.dim() == 1 else value))
                continue
            out.append(base(*call, **kw))
        return None if inplace else out

    return run


def _addc_tensor(base: Any, call: list[Any], value: torch.Tensor) -> Any:
    """``addcmul``/``addcdiv`` whose ``value`` is a tensor element (the foreach ``.Tensor`` forms,
    which eager reads number by number): ``self + value * t1 * t2`` (``/ t2``) in the kernel's order."""
    x, t1, t2 = call
    term = value.to(x.dtype) * t1
    term = term / t2 if base.__name__.startswith("addcdiv") else term * t2
    return x.add_(term) if base.__name__.endswith("_") else x + term


def _foreach_decompositions() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::_foreach_"):
            continue
        name, _, overload = qualified[len("aten::") :].partition(".")
        if overload.endswith("out"):
            continue
        op = name[len("_foreach_") :]
        base = getattr(aten, {"norm": "linalg_vector_norm"}.get(op, op), None)
        packet = getattr(aten, name, None)
        target = getattr(packet, overload or "default", None) if packet is not None else None
        if base is not None and target is not None:
            table[target] = _foreach(target, base, inplace=op.endswith("_"))
    return table


_EXTRA_DECOMPOSITIONS.update(_foreach_decompositions())
