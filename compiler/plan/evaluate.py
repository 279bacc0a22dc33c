"""Modeled step time of a whole plan: every reshard the partitioner will emit (each (value, target)
once, as the partitioner memoizes them) priced by the cost model, plus each op's FLOPs at its
chosen layout. The planner compares plans with it; ``Lowered.cost()`` reports it."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from compiler.plan.candidates import VIEWS
from compiler.plan.costmodel import CostModel, op_flops
from compiler.propagate_state import CONSTRAIN, OpPlan, Propagation, factor_sizes, shape
from compiler.reshard import plan
from compiler.sharding import Sharding
from compiler.sources import source_of
from shardspec.mesh import Mesh


@dataclass(frozen=True)
class ModeledTime:
    comm_s: float
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.comm_s + self.compute_s


def flops_of(node: Node, p: OpPlan, mesh: Mesh) -> float:
    """FLOPs of ``node`` on one rank under plan ``p``."""
    if node.target in VIEWS or node.target is CONSTRAIN or node.target is operator.getitem:
        return 0.0
    sizes = factor_sizes(p.rule, list(p.operands), node)
    split = {f: mesh.axis_size(axes) for f, axes in p.assignment if axes}
    return op_flops(p.rule, sizes, split, view=False)


def reshard_s(value: Node, src: Sharding, dst: Sharding, mesh: Mesh, model: CostModel) -> float:
    return model.steps_s(plan(shape(value), value.meta["val"].dtype, src, dst, mesh), mesh)


def again(value: Node, consumer: Node, regather: bool) -> bool:
    """A backward read of a step input: the regather pass gathers it a second time for backward."""
    return regather and value.op == "placeholder" and source_of(consumer).startswith("backward of ")


BUCKET_BYTES = 25 * 2**20  # the bucketing pass's default launch size (DDP's)


def _input_like(value: Node) -> bool:
    """A step input, or a view, transpose or cast of one (a weight's ``.t()``)."""
    while value.op == "call_function" and value.target in VIEWS and isinstance(value.args[0], Node):
        value = value.args[0]
    return value.op == "placeholder"


def _bucket(value: Node, consumer: Node | None, phase: bool) -> tuple[object, ...]:
    """The group of launches the bucketing pass merges this reshard into: gathers of step inputs
    (parameters: by phase, as backward's re-gathers are their own buckets), reductions of finished
    gradients (a backward value read after backward: the optimizer), results on their way out;
    any other reshard shares a launch only with those its own consumer needs (a loss's sum and
    count, reduced together), since the rest are needed at once."""
    if _input_like(value):
        return ("input", phase)
    if consumer is None:
        return ("output", False)
    if source_of(value).startswith("backward of ") and not source_of(consumer).startswith("backward of "):
        return ("gradient", False)
    return ("at", consumer)


def modeled_time(
    graph: torch.fx.Graph, prop: Propagation, mesh: Mesh, model: CostModel, regather: bool = True
) -> ModeledTime:
    """Communication and compute seconds of one step on one rank (no overlap assumed).

    Launches that the bucketing pass merges (``_bucket``: parameter gathers, gradient reductions,
    the reshards one op needs together) pay one latency per bucket of their kind, axes and dtype
    (one per ``BUCKET_BYTES`` sent), so a plan is not credited with launches bucketing removes
    anyway."""
    comm = compute = 0.0
    memo: set[tuple[Node, Sharding, bool]] = set()
    buckets: dict[tuple[object, ...], list[float]] = {}  # key -> [latency, bytes per rank]

    def need(value: Node, target: Sharding, consumer: Node | None, phase: bool = False) -> float:
        cur = prop.value[value]
        if cur == target or (value, target, phase) in memo:
            return 0.0
        memo.add((value, target, phase))
        assert isinstance(cur, Sharding)
        steps = plan(shape(value), value.meta["val"].dtype, cur, target, mesh)
        group = _bucket(value, consumer, phase)
        seconds = 0.0
        for st in steps:
            latency = model.collective_s(st.kind, st.axes, 0.0, mesh)
            seconds += model.collective_s(st.kind, st.axes, st.bytes_per_rank, mesh) - latency
            if latency:
                key = (*group, st.kind, st.axes, value.meta["val"].dtype)
                held = buckets.setdefault(key, [latency, 0.0])
                held[1] += st.bytes_per_rank
        return seconds

    for node in graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            p = prop.plans[node]
            for o, r in zip(p.operands, p.required, strict=True):
                comm += need(o, r, node, again(o, node, regather))
            compute += model.compute_s(flops_of(node, p, mesh))
        elif node.op == "output":
            for v, s in zip(node.args[0], prop.outputs, strict=True):
                if isinstance(v, Node):
                    comm += need(v, s, None)
    comm += sum(lat * max(1, math.ceil(sent / BUCKET_BYTES)) for lat, sent in buckets.values())
    return ModeledTime(comm, compute)
