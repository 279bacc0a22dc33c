"""User-level rewrites applied while tracing, before autograd sees the ops.

``scaled_dot_product_attention`` over (batch, heads, seq, dim) tensors without a mask, dropout or
grouped heads becomes a fused kernel itself: the CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``) on CPU tensors, the memory-efficient kernel
(``_scaled_dot_product_efficient_attention``) on CUDA tensors; the forward and backward of both have
rules with batch and heads as free factors. ATen's own choice of kernel
depends on conditions a trace should not, and its math fallback merges batch and heads into one dim. Any
other call becomes the math form (q·kᵀ·scale, mask, softmax, ·v). A matmul with several batch dims (q·kᵀ
over batch and heads) becomes one ``shardspec::matmul`` node: ATen would merge the batch dims into one
for ``bmm``, and a merged (batch, heads) dim split over two axes is not a block of anything. Dropout
and ``torch.rand*`` become counter-based (``compiler/random.py``: the same values whatever the
split); dropout inside SDPA, alpha dropout and other random ops are refused. ``one_hot`` becomes a
comparison with ``arange`` (its kernel validates label values, which a shape-only trace cannot do).
``linear_cross_entropy`` becomes linear then cross_entropy (its chunked kernel is one opaque op
that function transforms cannot differentiate);
``tensor_split`` at points held in a tensor is refused (the pieces' sizes depend on values).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx.traceback as fxt
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from compiler import random
from compiler.sources import user_frame
from shardspec.errors import fail

_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_DROPOUT = {
    F.dropout,
    torch.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    torch.nn.functional.feature_alpha_dropout,
}
RANDOM_OPS = {
    "aten.rand",
    "aten.randn",
    "aten.randint",
    "aten.bernoulli",
    "aten.native_dropout",
    "aten.rand_like",
    "aten.randn_like",
    "aten.randint_like",
    "aten.normal",
    "aten.uniform",
    "aten.multinomial",
    "aten.randperm",
    "aten.exponential",
}


@torch.library.custom_op("shardspec::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


@_matmul_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


class _BatchedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.shardspec.matmul(a, b)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        return batched_matmul(grad, b.transpose(-2, -1)), batched_matmul(a.transpose(-2, -1), grad)


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """matmul over identical leading batch dims, kept as one op with a rule."""
    out: torch.Tensor = _BatchedMatmul.apply(a, b)  # type: ignore[no-untyped-call]
    return out


def _many_batch_dims(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dim() >= 4
        and a.dim() == b.dim()
        and a.shape[:-2] == b.shape[:-2]
    )


_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """scaled_dot_product_attention in plain ops (no dropout). As eager: a mask is bool, fp32 or the
    query's dtype (anything else raises torch's error), and half precision on the CPU computes in
    fp32, rounding the result once (ATen's CPU kernels upcast too)."""
    if dropout_p > 0:
        raise _dropout_error(f"scaled_dot_product_attention(dropout_p={dropout_p})")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got "
            f"attn_mask.dtype: {attn_mask.dtype} and  query.dtype: {query.dtype} instead."
        )
    half = (torch.float16, torch.bfloat16)
    if query.device.type == "cpu" and query.dtype in half and key.dtype == value.dtype == query.dtype:
        mask = attn_mask.float() if attn_mask is not None and attn_mask.dtype in half else attn_mask
        out = sdpa_math(query.float(), key.float(), value.float(), mask, 0.0, is_causal, scale, enable_gqa)
        return out.to(query.dtype)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    mm = batched_matmul if _many_batch_dims(query, key) else torch.matmul
    scores = mm(query, key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask.to(scores.dtype)  # an fp32 bias on half scores: the scores' dtype
        )
        # torch's safe softmax: a query row whose every key is masked attends to nothing (zeros, and
        # zero gradients), not NaN; its scores are zeroed first so the softmax and its backward stay finite
        none = (scores == float("-inf")).all(dim=-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill(none, 0.0), dim=-1).masked_fill(none, 0.0)
    else:
        probs = torch.softmax(scores, dim=-1)
    return (batched_matmul if _many_batch_dims(probs, value) else torch.matmul)(probs, value)


def _fused_kernel(args: Any, kwargs: dict[str, Any]) -> str | None:
    """Which fused kernel computes an SDPA call exactly as asked: ``"cpu"`` (the CPU flash kernel),
    ``"cuda"`` (the memory-efficient CUDA kernel, which takes fp32 as well as half precision), or
    None (plain ops)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    call = dict(zip(names, args, strict=False)) | kwargs
    q, k, v = call.get("query"), call.get("key"), call.get("value")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    device = q.device.type
    fits = (
        call.get("attn_mask") is None
        and not call.get("dropout_p", 0.0)
        and set(call) <= set(names)
        and device == k.device.type == v.device.type
        and q.dtype == k.dtype == v.dtype
        and q.shape[:2] == k.shape[:2] == v.shape[:2]
        and k.shape[2] == v.shape[2]
        and q.shape[3] == k.shape[3] == v.shape[3]  # the kernels take one head size
        and min(q.shape[2], k.shape[2]) > 0
    )
    if fits and device == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "cpu"
    if fits and device == "cuda" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return "cuda" if q.shape[3] % 8 == 0 and q.shape[3] <= 256 else None  # the kernel's alignment
    return None


def sdpa_fused(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """scaled_dot_product_attention as the fused kernel ``_fused_kernel`` picked for it. The kernels
    read each row of q, k and v as dense memory (eager torch checks and takes the math kernel
    otherwise): an operand whose last dim is strided (``x.mT``) is made contiguous first."""
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if query.device.type == "cuda":
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, 0.0, bool(is_causal), scale=scale
        )[0]
    else:
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, bool(is_causal), scale=scale
        )
    return out  # type: ignore[no-any-return]


def _dropout_error(what: str) -> Exception:
    return fail(
        f"{what} at {user_frame()}: this dropout has no counter-based form (F.dropout and "
        "dropout1d/2d/3d do: the same mask on every mesh), and its own random numbers would "
        "depend on how tensors are split.",
        "use p=0 (or eval mode) here, or F.dropout (e.g. on the attention probabilities of a math "
        "attention instead of scaled_dot_product_attention's dropout_p).",
    )


@torch.library.custom_op("shardspec::check_classes", mutates_args=())
def _check_classes(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``labels`` (a copy), after the range check F.one_hot's kernel makes, with its messages (on
    an accelerator an asynchronous assert, so the check does not wait for the device)."""
    if labels.device.type != "cpu":
        torch._assert_async(
            (labels >= 0).all() & (labels < num_classes).all(), "Class values must be in [0, num_classes)."
        )
        return labels.clone()
    if labels.numel() and bool((labels < 0).any()):
        raise RuntimeError("Class values must be non-negative.")
    if labels.numel() and bool((labels >= num_classes).any()):
        raise RuntimeError("Class values must be smaller than num_classes.")
    return labels.clone()


@_check_classes.register_fake
def _(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.empty_like(labels)


def one_hot(labels: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """F.one_hot as a comparison with arange: ATen's kernel checks the labels' range on their
    values, which a shape-only trace cannot see (it read as user control flow). The check runs
    when the program runs instead (``shardspec::check_classes``, elementwise: each device checks
    its own labels), so a label out of range is eager's error, not a row of zeros. Without
    num_classes the width is the largest label + 1, a value the step cannot be compiled on."""
    if num_classes < 0:
        raise fail(
            f"F.one_hot without num_classes at {user_frame()}: the number of classes would be the "
            "largest label + 1, which depends on tensor values; the step is traced on shapes only.",
            "pass num_classes=<number of classes> to F.one_hot.",
        )
    classes = torch.arange(num_classes, device=labels.device, dtype=labels.dtype)
    checked: torch.Tensor = torch.ops.shardspec.check_classes(labels, num_classes)
    return (checked.unsqueeze(-1) == classes).to(torch.int64)


_ONE_HOT = {F.one_hot, torch._C._nn.one_hot}
_LINEAR_CE = {getattr(F, "linear_cross_entropy", None)} - {None}
_TENSOR_SPLIT = {torch.tensor_split, torch.Tensor.tensor_split}
_RRELU = {F.rrelu, torch.rrelu}
_RRELU_INPLACE = {F.rrelu_, torch.rrelu_}


def _rrelu_eval(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, float, bool] | None:
    """(input, slope, inplace) of an rrelu that is not training, else None. Out of training rrelu
    is leaky_relu with the mean slope (torch's kernel computes exactly that): deterministic, with a
    rule, where its training form draws a slope per element."""
    names = ("input", "lower", "upper", "training", "inplace" if func is F.rrelu else "generator")
    bound = dict(zip(names, args, strict=False)) | kwargs
    if func in _RRELU_INPLACE:
        bound["inplace"] = True
    if bound.get("training", False) or "generator" in bound:
        return None
    lower, upper = bound.get("lower", 1.0 / 8), bound.get("upper", 1.0 / 3)
    return bound["input"], (lower + upper) / 2, bool(bound.get("inplace", False))


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options: Any = None,
) -> torch.Tensor:
    """F.linear_cross_entropy as its reference form, linear then cross_entropy: the chunked kernels
    are one opaque op (with an autograd.Function that function transforms cannot differentiate),
    while the two plain ops have rules; chunking only saves memory, the values are the same."""
    logits = F.linear(input, linear_weight, linear_bias)
    return F.cross_entropy(
        logits,
        target,
        weight=weight,
        reduction=reduction,
        ignore_index=-100 if ignore_index is None else ignore_index,
        label_smoothing=label_smoothing,
    )


def _split_points(args: Any, kwargs: dict[str, Any]) -> Any:
    for key in ("indices_or_sections", "tensor_indices_or_sections", "indices", "sections"):
        if key in kwargs:
            return kwargs[key]
    return args[1] if len(args) > 1 else None


_BACKWARD = {torch.Tensor.backward, torch.autograd.backward}
_LINEAR = {F.linear, torch._C._nn.linear}


def _linear_then_bias(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A linear layer on a batch of sequences as the product, its view back to (..., out), then
    the bias add (marked as an addmm's: the per-rank program fuses it back into one addmm where no
    collective comes between). torch folds the leading dims and adds the bias on the folded rows,
    so a row-parallel layer's pending sum had to be reduced on those rows, where a sequence split
    is no block: reduced after the view, it can be reduce-scattered over the sequence (sequence
    parallelism) instead of all-reduced."""
    from compiler.decompose import ADDMM_MARK

    x, weight = args[0] if args else kwargs["input"], args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not (
        isinstance(bias, torch.Tensor)
        and isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and x.dim() > 2
        and weight.dim() == 2
        and bias.dim() == 1
        and x.dtype == weight.dtype == bias.dtype
        and not torch.is_autocast_enabled(x.device.type)  # autocast casts the three together
    ):
        return None
    out = F.linear(x, weight)
    with fxt.annotate({ADDMM_MARK: True}):
        return out + bias


class Rewrites(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _BACKWARD:
            raise fail(
                f"backward() at {user_frame()}: a sharded step is a function of its inputs, and "
                "its gradients are results it computes and returns, not .grad fields filled in.",
                "compute them with loss, grads = shardspec.value_and_grad(loss_fn)(params, batch) "
                "inside the step and return them (or apply the optimizer update there).",
            )
        if func in _SDPA:
            return (sdpa_fused if _fused_kernel(args, kwargs) else sdpa_math)(*args, **kwargs)
        if func in _ONE_HOT:
            return one_hot(*args, **kwargs)
        if func in _LINEAR_CE:
            return linear_cross_entropy(*args, **kwargs)
        if func in _LINEAR and (linear := _linear_then_bias(args, kwargs)) is not None:
            return linear
        if func in _RRELU | _RRELU_INPLACE and (leaky := _rrelu_eval(func, args, kwargs)) is not None:
            return F.leaky_relu(leaky[0], leaky[1], inplace=leaky[2])
        if func in _TENSOR_SPLIT and isinstance(_split_points(args, kwargs), torch.Tensor):
            raise fail(
                f"tensor_split at {user_frame()} with split points in a tensor: the size of each piece "
                "depends on tensor values, and the step is traced once on shapes only.",
                "pass the split points as a Python list of ints.",
            )
        if func in _MATMUL and len(args) == 2 and not kwargs and _many_batch_dims(*args):
            return batched_matmul(*args)
        if random.handles(func, kwargs):  # counter-based: the same values on every mesh
            return random.rewrite(self, func, args, kwargs)
        if func in _DROPOUT:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if p > 0 and training:
                raise _dropout_error(f"{getattr(func, '__name__', 'dropout')}(p={p})")
        return func(*args, **kwargs)
