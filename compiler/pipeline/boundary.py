"""``pipeline_boundary(x)``: mark a cut between pipeline stages inside the model.

It traces as one identity node, ``shardspec.pipeline_boundary(x, cut = k, backward = False)``;
its gradient is the same op with ``backward = True``, so the traced step carries forward cut ``k``
and backward cut ``k``. Cuts are numbered in the order a microbatch's forward meets them (the
numbering restarts with each microbatch). Without ``sharded(pipeline=...)`` a boundary is removed
from the per-rank program (an identity costs nothing).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from shardspec.errors import fail

# the next cut number of the microbatch being traced (value_and_grad resets it per microbatch)
_NEXT_CUT: contextvars.ContextVar[int] = contextvars.ContextVar("shardspec_next_cut", default=0)


@contextlib.contextmanager
def cuts_from_zero() -> Iterator[None]:
    """Number the boundaries met inside from 0 (one microbatch's forward)."""
    token = _NEXT_CUT.set(0)
    try:
        yield
    finally:
        _NEXT_CUT.reset(token)


@torch.library.custom_op("shardspec::pipeline_boundary", mutates_args=())
def _boundary(x: torch.Tensor, *, cut: int, backward: bool) -> torch.Tensor:
    return x.clone()


@_boundary.register_fake
def _(x: torch.Tensor, *, cut: int, backward: bool) -> torch.Tensor:
    return torch.empty_like(x)


BOUNDARY = torch.ops.shardspec.pipeline_boundary.default


class _Boundary(torch.autograd.Function):
    """Cut k in one direction; its gradient crosses cut k the other way (functorch-compatible)."""

    @staticmethod
    def forward(x: torch.Tensor, cut: int, backward: bool) -> torch.Tensor:
        return torch.ops.shardspec.pipeline_boundary(x, cut=cut, backward=backward)  # type: ignore[no-any-return]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.cut, ctx.backward = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _Boundary.apply(grad, ctx.cut, not ctx.backward), None, None  # type: ignore[no-untyped-call]


def pipeline_boundary(x: torch.Tensor) -> torch.Tensor:
    """Cut the model here: what comes before runs on an earlier pipeline stage than what follows.

    An identity: without ``sharded(pipeline=...)`` it changes nothing. With more boundaries than
    stages the compiler picks the cuts that balance the stages' cost.
    """
    if not isinstance(x, torch.Tensor):
        raise fail(
            f"pipeline_boundary: expected a tensor, got {type(x).__name__}.",
            "pass the activation that flows to the next stage (one tensor per boundary).",
        )
    cut = _NEXT_CUT.get()
    _NEXT_CUT.set(cut + 1)
    out: torch.Tensor = _Boundary.apply(x, cut, False)  # type: ignore[no-untyped-call]
    return out
