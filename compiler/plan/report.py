"""Modeled seconds of a compiled program, for ``Lowered.cost()``: each launch the program really
issues (after bucketing and re-gathers) by the ring formulas of ``costmodel.py``, plus every op's
FLOPs at its planned layout over the device's rate."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from compiler.plan.costmodel import CostModel
from compiler.plan.evaluate import flops_of

if TYPE_CHECKING:
    from compiler.program import Program


def modeled_seconds(
    program: Program, launches: Iterable[tuple[str, tuple[str, ...], float]]
) -> tuple[float, float]:
    """(communication, compute) seconds on ``program.cost_model`` (the default machine if none)."""
    model = program.cost_model if isinstance(program.cost_model, CostModel) else CostModel()
    mesh = program.mesh
    comm = sum(model.collective_s(kind, axes, sent, mesh) for kind, axes, sent in launches)
    compute = sum(model.compute_s(flops_of(n, p, mesh)) for n, p in program.prop.plans.items())
    return comm, compute
