"""Modeled step time of a whole plan: every reshard the partitioner will emit (each (value, target)
once, as the partitioner memoizes them) priced by the cost model, plus each op's FLOPs at its
chosen layout. The planner compares plans with it; ``Lowered.cost()`` reports it."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from compiler.plan.candidates import VIEWS, factor_sizes
from compiler.plan.costmodel import CostModel, op_flops
from compiler.propagate_state import CONSTRAIN, OpPlan, Propagation, shape
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


def modeled_time(
    graph: torch.fx.Graph, prop: Propagation, mesh: Mesh, model: CostModel, regather: bool = True
) -> ModeledTime:
    """Communication and compute seconds of one step on one rank (no overlap assumed)."""
    comm = compute = 0.0
    memo: set[tuple[Node, Sharding, bool]] = set()

    def need(value: Node, target: Sharding, phase: bool = False) -> float:
        cur = prop.value[value]
        if cur == target or (value, target, phase) in memo:
            return 0.0
        memo.add((value, target, phase))
        assert isinstance(cur, Sharding)
        return reshard_s(value, cur, target, mesh, model)

    for node in graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            p = prop.plans[node]
            for o, r in zip(p.operands, p.required, strict=True):
                comm += need(o, r, again(o, node, regather))
            compute += model.compute_s(flops_of(node, p, mesh))
        elif node.op == "output":
            for v, s in zip(node.args[0], prop.outputs, strict=True):
                if isinstance(v, Node):
                    comm += need(v, s)
    return ModeledTime(comm, compute)
