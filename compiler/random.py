"""Counter-based random numbers: the same values whatever the mesh and specs.

A sharded step must give every element the same random value wherever it lives, or a split step
would drop different activations than the unsharded one. torch's generators produce a stream, so
which value an element gets depends on how many came before it on its device. Here a value is a
pure function of (key, counter, global element index):

    bits(i) = h(h((i mod 2^32) xor s) xor floor(i / 2^32))
    s       = h(h((key mod 2^32) xor c) xor floor(key / 2^32))

where ``h`` is a 32-bit integer mixing function (xor-shift-multiply, two rounds), ``c`` a constant
derived from the op's position in trace order, and ``i`` the element's row-major index in the
*global* shape. ``i`` is built as a sum of per-dim ``arange`` vectors times the strides; ``arange``
stays whole (replicated) under propagation, so each device slices exactly its global block of it,
and every following op is elementwise: splitting is exact, and a sharded step with dropout equals the
unsharded one bit for bit. Uniform floats take the top 24 bits (``u = (bits >> 8) / 2^24``);
normals use Box–Muller on two uniforms.

The key is an int64 scalar tensor (``shardspec.random.key(seed)``), passed to the step like any
argument and installed with ``shardspec.random.rng(key)`` inside it; without one, ops draw from
``DEFAULT_SEED`` (the same masks every call: pass a key that changes per step to vary them).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from compiler.sources import user_frame
from shardspec.errors import fail
from shardspec.random import DEFAULT_SEED

_M32 = 2**32
_DROPOUT = {F.dropout, torch.dropout, torch.nn.functional.dropout1d, F.dropout2d, F.dropout3d}
_RAND = {torch.rand, torch.randn, torch.rand_like, torch.randn_like}
FUNCS = _DROPOUT | _RAND


class _Stream:
    """One source of keys: a key tensor (or the default seed) and the number of draws so far."""

    def __init__(self, key: torch.Tensor | None) -> None:
        self.key, self.count = key, 0

    def next_seed(self, device: torch.device) -> torch.Tensor:
        self.count += 1
        key = self.key
        if key is None:
            key = torch.full((), DEFAULT_SEED, dtype=torch.int64, device=device)
        key = key.to(torch.int64)
        c = torch.full((), _hash_int(self.count * 0x9E3779B9 % _M32), dtype=torch.int64, device=device)
        return _hash(_hash(torch.remainder(key, _M32) ^ c) ^ torch.div(key, _M32, rounding_mode="floor"))


_current: contextvars.ContextVar[_Stream | None] = contextvars.ContextVar("shardspec_rng", default=None)


def _hash_int(x: int) -> int:
    """``_hash`` on a Python int (for constants)."""
    for mul in (0x7FEB352D, 0x846CA68B):
        x ^= x >> 16
        x = (x * mul) % _M32
    return x ^ (x >> 16)


def _hash(x: torch.Tensor | int) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift-multiply) on int64 tensors holding values in [0, 2^32).
    Products may wrap past 2^63; their low 32 bits, all that is kept, are still exact."""
    t = torch.as_tensor(x, dtype=torch.int64)
    for mul, shift in ((0x7FEB352D, 16), (0x846CA68B, 15)):
        t = t ^ torch.div(t, 2**shift, rounding_mode="floor")
        t = torch.remainder(t * mul, _M32)
    return t ^ torch.div(t, 2**16, rounding_mode="floor")


def _global_index(shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """Each element's row-major index in ``shape``, as a broadcast sum of per-dim aranges."""
    if not shape:
        return torch.zeros((), dtype=torch.int64, device=device)
    index: torch.Tensor | None = None
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[d] = shape[d]
        term = torch.arange(shape[d], dtype=torch.int64, device=device).view(view) * stride
        index = term if index is None else index + term
        stride *= shape[d]
    assert index is not None
    return index


def bits(shape: Sequence[int], seed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """32 random bits (in int64) per element of ``shape``, from the per-op ``seed``."""
    i = _global_index(shape, device)
    low = torch.remainder(i, _M32) ^ seed
    return _hash(_hash(low) ^ torch.div(i, _M32, rounding_mode="floor")).expand(tuple(shape))


def uniform(
    shape: Sequence[int], seed: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Uniform values in [0, 1) with as many random bits as ``dtype`` holds exactly (24 at most:
    bf16 8, fp16 11), so no value rounds up to 1.0 in a narrow dtype."""
    digits = min(24, 1 - round(math.log2(torch.finfo(dtype).eps))) if dtype.is_floating_point else 24
    top = torch.div(bits(shape, seed, device), 2 ** (32 - digits), rounding_mode="floor")
    return (top.to(torch.float64) * 2.0**-digits).to(dtype)


def normal(shape: Sequence[int], stream: _Stream, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Standard normal values by Box–Muller (u1 shifted into (0, 1] so the log is finite)."""
    u1 = 1.0 - uniform(shape, stream.next_seed(device), torch.float64, device)
    u2 = uniform(shape, stream.next_seed(device), torch.float64, device)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)).to(dtype)


def channel_shape(name: str, shape: Sequence[int]) -> list[int]:
    """The mask shape of channel-wise dropout, by torch's rules: dropout1d takes (C, L) and
    dropout3d any input but 5-D as unbatched (one mask value per channel, dim 0); dropout2d and the
    batched forms take (N, C, ...) (one value per (sample, channel))."""
    dim = len(shape)
    if name == "dropout1d" and dim not in (2, 3):
        raise fail(
            f"dropout1d at {user_frame()} on a {dim}-D input of shape {tuple(shape)}: dropout1d takes "
            "2-D (C, L) or 3-D (N, C, L) inputs.",
            "reshape the input to (N, C, L) or (C, L), or use F.dropout for element-wise dropout.",
        )
    unbatched = (name == "dropout1d" and dim == 2) or (name == "dropout3d" and dim != 5)
    if unbatched and dim >= 1:
        return [shape[0]] + [1] * (dim - 1)
    if dim < 2:
        raise fail(
            f"{name} at {user_frame()} on a {dim}-D input of shape {tuple(shape)}: channel-wise "
            "dropout needs a channel dim (torch: feature dropout requires at least 2 dimensions).",
            "use F.dropout for element-wise dropout, or give the input (N, C, ...) dims.",
        )
    return list(shape[:2]) + [1] * (dim - 2)


def dropout(
    x: torch.Tensor, p: float, stream: _Stream, mask_shape: Sequence[int] | None = None
) -> torch.Tensor:
    """Zero each element (or each channel: one mask value per element of ``mask_shape``) with
    probability ``p``; scale the rest by 1 / (1 - p), as F.dropout does."""
    if p >= 1:
        return x * 0.0
    shape = list(x.shape) if mask_shape is None else list(mask_shape)
    keep = uniform(shape, stream.next_seed(x.device), torch.float32, x.device) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


def _check_p(name: str, p: float) -> None:
    """torch refuses a dropout probability outside [0, 1] (ValueError); so does the rewrite,
    instead of scaling by 1 / (1 - p) < 1 or zeroing everything."""
    if not 0.0 <= p <= 1.0:
        raise fail(
            f"{name}(p={p}) at {user_frame()}: dropout probability has to be between 0 and 1, but got {p}.",
            "pass p in [0, 1] (the probability of zeroing an element).",
        )


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else default


def _size(args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    size = kwargs.get("size", args[0] if len(args) == 1 else args)
    if isinstance(size, int):
        size = [size]
    return [int(s) for s in size]


def handles(func: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` is drawn counter-based: dropout, and rand* without an explicit torch
    Generator (whose own stream a user asked for; it stays refused inside a step)."""
    return func in FUNCS and kwargs.get("generator") is None


def rewrite(owner: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Compute ``func`` (dropout or rand*) counter-based. Draws come from the innermost
    ``rng(key)`` scope, else from a default stream kept on ``owner`` (one per trace)."""
    stream = _current.get()
    if stream is None:
        stream = owner.__dict__.setdefault("_shardspec_stream", _Stream(None))
    if func in _DROPOUT:
        x = args[0]
        name = getattr(func, "__name__", "dropout")
        p = float(_arg(args, kwargs, 1, "p", 0.5))
        _check_p(name, p)
        train = _arg(args, kwargs, 2, "training" if func is not torch.dropout else "train", True)
        per_channel = func is not F.dropout and func is not torch.dropout
        if func is F.dropout1d:  # torch checks dropout1d's rank even when nothing is dropped
            channel_shape(name, list(x.shape))
        if not train or p == 0:
            return x
        mask_shape = channel_shape(name, list(x.shape)) if per_channel else None
        out = dropout(x, p, stream, mask_shape)
        # in place (nn.Dropout(inplace=True) used as a statement): write the result into x, which
        # the trace's functionalization turns into a functional update of x
        return x.copy_(out) if _arg(args, kwargs, 3, "inplace", False) else out
    if func in (torch.rand_like, torch.randn_like):
        like = args[0]
        shape, dtype, device = list(like.shape), kwargs.get("dtype") or like.dtype, like.device
    else:
        shape = _size(args, {k: v for k, v in kwargs.items() if k == "size"})
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        device = torch.device(kwargs.get("device") or "cpu")
    if func in (torch.rand, torch.rand_like):
        return uniform(shape, stream.next_seed(device), dtype, device)
    return normal(shape, stream, dtype, device)


class _RandomMode(TorchFunctionMode):
    """Rewrites dropout and rand* into the counter-based versions (outside a trace as well, so an
    eager run inside ``rng(key)`` draws the same values as the compiled step)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if handles(func, kwargs):
            return rewrite(self, func, args, kwargs)
        return func(*args, **kwargs)


def check_no_outer_rng(name: str) -> None:
    """A step called inside ``rng(key)``: its compiled program cannot see that key (the key is
    not one of its inputs, and a cached program would keep the first call's draws), so say how to
    pass it."""
    if _current.get() is not None:
        name = name if name.replace(".", "_").isidentifier() else "step"  # not "<lambda>"
        raise fail(
            f"{name}(...) was called inside shardspec.random.rng(key): a sharded step draws from a "
            "key it receives as an argument, not from a scope around the call (its compiled "
            "program would draw the same numbers whatever the surrounding key).",
            f"pass the key to the step (spec P()) and open the scope inside it: def {name}(..., "
            f"key): with shardspec.random.rng(key): ...; then call {name}(..., fold_in(base, i)).",
        )


@contextlib.contextmanager
def rng(key: torch.Tensor | int) -> Iterator[None]:
    """Draw dropout masks and ``torch.rand*`` values inside the block from ``key``."""
    if isinstance(key, int):
        key = torch.tensor(key, dtype=torch.int64)
    token = _current.set(_Stream(key))
    try:
        with _RandomMode():
            yield
    finally:
        _current.reset(token)
