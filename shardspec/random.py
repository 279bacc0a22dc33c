"""Random numbers inside a sharded step that do not depend on the mesh or the specs.

Inside ``@sharded`` (and in an eager run inside ``rng(key)``), ``F.dropout`` (``nn.Dropout``,
``dropout1d/2d/3d``) and ``torch.rand`` / ``randn`` / ``rand_like`` / ``randn_like`` are computed
counter-based: an element's value is a function of the key, the op's position in the step (trace
order) and the element's index in the *global* tensor, never of which device holds it. So a sharded
step with dropout drops exactly the elements the unsharded step drops, on every mesh.
As in torch, ``inplace=True`` updates its input, dropout1d/3d on an unbatched input ((C, L),
(C, D, H, W)) draw one mask value per channel, and p outside [0, 1] is a ValueError.

The key is an explicit input, JAX-style: make one with ``key(seed)``, derive one per step with
``fold_in(key, step)``, pass it to the step like any tensor (spec ``P()``) and draw under
``rng(key)``. Without ``rng``, draws use the documented default seed 0, so every call of the step
draws the same masks. Example::

    base = shardspec.random.key(0)

    @sharded(mesh=mesh, in_specs=(pspec, P("dp"), P()), out_specs=P())
    def step(params, x, key):
        with shardspec.random.rng(key):
            return loss_fn(params, x)  # F.dropout inside draws from key

    for i in range(steps):
        loss = step(params, x, shardspec.random.fold_in(base, i))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEFAULT_SEED = 0


def key(seed: int) -> torch.Tensor:
    """A random key: an int64 scalar tensor holding ``seed`` (0 <= seed < 2^63).

    Example::

        >>> shardspec.random.key(42)
        tensor(42)
    """
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        from shardspec.errors import fail, shown

        raise fail(f"random.key({shown(seed)}): a seed is an int in [0, 2^63).", "pass e.g. random.key(0).")
    return torch.tensor(seed, dtype=torch.int64)


def fold_in(key: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key derived from ``key`` and ``data`` (e.g. the step number): different data give
    unrelated streams. Works eagerly and inside a step.

    Example::

        >>> k1 = shardspec.random.fold_in(shardspec.random.key(0), 1)
    """
    from compiler.random import _M32, _hash

    key = as_key(key, "fold_in(key, ...)")
    d = as_key(data, "fold_in(..., data)", "data").to(torch.int64)  # (an int32 step counter too)
    low = _hash(torch.remainder(key.to(torch.int64), _M32) ^ _hash(torch.remainder(d, _M32)))
    return _hash(low ^ torch.div(key.to(torch.int64), _M32, rounding_mode="floor")) + _M32 * torch.remainder(
        torch.div(d, _M32, rounding_mode="floor"), _M32
    )


def as_key(x: torch.Tensor | int, where: str, noun: str = "a key") -> torch.Tensor:
    """``x`` as a key: an int (a seed) or a 0-dim integer tensor; anything else is refused rather
    than broadcast into the draws (a JAX-style 2-element key) or truncated (a float)."""
    if isinstance(x, int) and not isinstance(x, bool):
        return torch.tensor(x, dtype=torch.int64)
    integer = isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex())
    if integer and x.dim() == 0 and x.dtype is not torch.bool:  # type: ignore[union-attr]
        return x  # type: ignore[return-value]
    from shardspec.errors import fail, shown

    what = f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else shown(x)
    raise fail(
        f"shardspec.random.{where}: {noun} is an int or a 0-dim integer tensor, got {what}.",
        "make one with shardspec.random.key(seed) and derive others with fold_in(key, step); a "
        "key is one int64 value here, not JAX's two-element key.",
    )


@contextlib.contextmanager
def rng(key: torch.Tensor | int) -> Iterator[None]:
    """Draw dropout masks and ``torch.rand*`` values in the block from ``key`` (a tensor from
    ``key()``/``fold_in()``, or an int seed). Inside a step each random op takes the next counter in
    trace order, so the same step draws the same values on every mesh.

    Example::

        with shardspec.random.rng(key):
            h = F.dropout(h, p=0.1)
    """
    from compiler.random import rng as _rng

    with _rng(as_key(key, "rng(key)")):
        yield
