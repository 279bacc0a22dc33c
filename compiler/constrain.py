"""``constrain(x, spec)``: pin an intermediate's sharding inside a step.

It traces as one node, ``shardspec.constrain(x, spec = "('dp', None)")``, that propagation treats as
fixed; its gradient is constrained the same way (the transpose of a sharding constraint is itself).
"""

from __future__ import annotations

import ast
from typing import Any

import torch

from shardspec.errors import fail, shown
from shardspec.spec import P


def encode(spec: P) -> str:
    return repr(tuple(spec.entries))


def decode(text: str) -> P:
    return P(*ast.literal_eval(text))


@torch.library.custom_op("shardspec::constrain", mutates_args=())
def _constrain(x: torch.Tensor, *, spec: str) -> torch.Tensor:
    return x.clone()


@_constrain.register_fake
def _(x: torch.Tensor, *, spec: str) -> torch.Tensor:
    return torch.empty_like(x)


class _Constrain(torch.autograd.Function):
    """The gradient of a constrained value is constrained the same way (functorch-compatible)."""

    @staticmethod
    def forward(x: torch.Tensor, spec: str) -> torch.Tensor:
        return torch.ops.shardspec.constrain(x, spec=spec)  # type: ignore[no-any-return]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Constrain.apply(grad, ctx.spec), None  # type: ignore[no-untyped-call]


def constrain(x: torch.Tensor, spec: P) -> torch.Tensor:
    """Require ``x`` to have sharding ``spec`` at this point of the step (checked when compiled);
    its gradient is constrained the same way. Outside a sharded step it returns ``x``. Example::

        h = constrain(h, P("dp", "tp"))  # sequence parallel: the residual stream split over tp
    """
    if not isinstance(spec, P):
        raise fail(
            f"constrain: spec must be a P(...), got {shown(spec)}.", "write constrain(x, P('dp', None))."
        )
    if not isinstance(x, torch.Tensor):
        raise fail(f"constrain: expected a tensor, got {type(x).__name__}.", "constrain tensors only.")
    spec.check_rank(x.dim(), name="constrain", shape=tuple(x.shape))
    out: torch.Tensor = _Constrain.apply(x, encode(spec))  # type: ignore[no-untyped-call]
    return out
