"""Shared state of the propagation sweeps: the plan types, the rules cache, constraints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from compiler.constrain import decode
from compiler.reshard import Step
from compiler.rules.notation import Rule, parse
from compiler.rules.registry import MissingRule, rule_for
from compiler.sharding import Axes, Sharding
from compiler.sources import source_of
from shardspec.errors import fail
from shardspec.mesh import Mesh

CONSTRAIN = torch.ops.shardspec.constrain.default
Want = tuple[Axes | None, ...]
aten = torch.ops.aten
_VIEW_LIKE = {
    aten.permute.default,
    aten.permute_copy.default,
    aten.t.default,
    aten.t_copy.default,
    aten.transpose.int,
    aten.transpose_copy.int,
    aten.view.default,
    aten.view_copy.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.unsqueeze_copy.default,
    aten.squeeze.dims,
    aten.squeeze_copy.dims,
    aten.clone.default,
    aten._to_copy.default,
    aten.expand.default,
    aten.expand_copy.default,
    aten.alias.default,
    aten.alias_copy.default,
    aten.slice_copy.Tensor,
}  # per dim: the axes a consumer wants, or None for no preference


@dataclass(frozen=True)
class OpPlan:
    """What one op runs on: its rule, operands, their required shardings, and its outputs'."""

    rule: Rule
    operands: tuple[Node, ...]
    required: tuple[Sharding, ...]
    outputs: tuple[Sharding, ...]
    assignment: tuple[tuple[str, Axes], ...]


@dataclass
class Propagation:
    value: dict[Node, Sharding] = field(default_factory=dict)
    plans: dict[Node, OpPlan] = field(default_factory=dict)
    outputs: list[Sharding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _node(a: Any) -> Node:
    assert isinstance(a, Node), a
    return a


def _numel(n: Node) -> int:
    v = n.meta.get("val")
    return int(v.numel()) if isinstance(v, torch.Tensor) else 0


def shape(n: Node) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def factor_sizes(rule: Rule, operands: list[Node], node: Node) -> dict[str, int]:
    """Global length of each factor that names a whole dim."""
    sizes: dict[str, int] = {}
    vals = node.meta.get("val")  # none for an op with no result (a check that may raise)
    outs = vals if isinstance(vals, (tuple, list)) else [] if vals is None else [vals]
    pairs = [
        *zip(rule.operands, (shape(o) for o in operands), strict=True),
        *zip(rule.outputs, (tuple(v.shape) if v is not None else () for v in outs), strict=True),
    ]
    for toks, shp in pairs:
        for t, n in zip(toks, shp, strict=False):
            if len(t) == 1:
                sizes[t[0]] = n
    return sizes


def _replicate_rule(node: Node) -> tuple[Rule, list[Node]]:
    operands = list(node.all_input_nodes)  # tensors nested in list arguments and kwargs too
    toks = [[f"o{i}_{d}!" for d in range(len(shape(a)))] for i, a in enumerate(operands)]
    vals = node.meta.get("val")  # none for an op with no result (a check that may raise)
    outs = vals if isinstance(vals, (tuple, list)) else [] if vals is None else [vals]
    # a multi-result op may return None for results nobody asked for (convolution_backward's mask)
    otoks = [[f"r{i}_{d}!" for d in range(v.dim() if v is not None else 0)] for i, v in enumerate(outs)]
    from compiler.rules.notation import line

    return parse(line(toks, otoks), "none"), operands


class PropagatorBase:
    """What every part of the propagator reads and writes."""

    def __init__(
        self,
        graph: torch.fx.Graph,
        inputs: list[Sharding],
        outputs: list[Sharding],
        mesh: Mesh,
        unsupported: str,
        strict: bool = False,
    ) -> None:
        self.graph, self.mesh, self.unsupported, self.strict = graph, mesh, unsupported, strict
        self.result = Propagation()
        self.inputs, self.out_specs = inputs, outputs
        self.want: dict[Node, Want] = {}
        self.memo: set[tuple[Node, Sharding]] = set()
        self.moved: dict[Node, list[Sharding]] = {}  # value -> the layouts memo moved it to
        self.rules: dict[Node, tuple[Rule, list[Node]]] = {}
        self.fallbacks: set[Node] = set()  # ops without a rule, run replicated (unsupported=)
        self.partial_hint: set[Node] = set()  # values that ended Partial in the previous pass
        self.reduce_now: dict[tuple[Node, Node], bool] = {}  # (pending value, consumer) -> reduce?
        self.plans: dict[tuple[Any, ...], list[Step]] = {}  # (shape, dtype, src, dst) -> collectives

    def rule(self, node: Node) -> tuple[Rule, list[Node]]:
        if node not in self.rules:
            try:
                self.rules[node] = rule_for(node)
            except MissingRule:
                if getattr(node.target, "namespace", None) == "shardspec":
                    # a collective of the library called in the step: replicating would gather its
                    # input and then reduce it again (a doubled all-reduce)
                    raise fail(
                        f"{node.target} at {source_of(node) or node.name} is one of shardspec's own "
                        "collectives, called inside a sharded step: the step's collectives come from "
                        "its specs, so it cannot be placed.",
                        "drop the collective and say the layout you want instead: constrain(x, P()) "
                        "for a value whole on every device (a pending sum is reduced there), or "
                        f"constrain(x, P({self.mesh.axis_names[0]!r})) to split it.",
                    ) from None
                if self.unsupported != "replicate" and self.held_whole(node):
                    # every rank holds every operand whole: running it replicated moves nothing.
                    # Not remembered: a later sweep may find its operands split
                    return _replicate_rule(node)
                if self.unsupported != "replicate":
                    where = source_of(node) or "an op with no recorded source line"
                    raise fail(
                        f"no sharding rule for {node.target} (from {where}).",
                        "rewrite that line with supported ops, or pass unsupported='replicate' to "
                        "sharded() to gather this op's inputs (a warning names each such op).",
                    ) from None
                import warnings

                warnings.warn(
                    f"shardspec: no sharding rule for {node.target} ({source_of(node)}); "
                    "gathering its inputs and running it replicated",
                    stacklevel=2,
                )
                self.rules[node] = _replicate_rule(node)
                self.fallbacks.add(node)
                self.result.notes.append(f"replicated fallback for {node.target} ({source_of(node)})")
        return self.rules[node]

    def held_whole(self, node: Node) -> bool:
        """Whether every operand of ``node`` is already placed whole (replicated, no pending sum)."""
        for o in node.all_input_nodes:
            s = self.result.value.get(o)
            if not isinstance(s, Sharding) or any(s.dims) or s.partial:
                return False
        return True

    def constraint(self, node: Node) -> Sharding:
        """The sharding a ``constrain`` node pins, checked against the mesh."""
        spec = decode(str(node.kwargs["spec"]))
        where = source_of(node)
        if where.startswith("backward of "):
            where = where[len("backward of ") :]
        spec.validate(
            self.mesh, len(shape(node)), name=f"constrain at {where or node.name}", shape=shape(node)
        )
        return Sharding.of(spec, len(shape(node)), self.mesh)
