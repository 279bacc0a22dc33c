"""Stage 3: give every value a sharding and every op a factor assignment.

Backward sweep: out_specs and constraints become *wants* that flow to operands through pass-through
factors. Forward sweep, in program order: each op's candidates assign mesh axes to its rule's factors
from what its operands carry and what its output is wanted as. A candidate is scored by (reduction
factors it splits only by resharding an operand first — that would turn data parallelism into a
partial sum; bytes to reshard the operands and then the output to its want; collective count; reuse
of values earlier ops already moved; then more split factors). Wants do not cross contractions: a
gradient's layout says nothing reliable about the activations that made it. A Partial operand stays
pending through a linear op unless another consumer must see it reduced (then it is reduced here,
once, and reused), its reduced form already exists, or the op would enlarge it (reducing the smaller
value sends fewer bytes). Whether a consumer can take a pending value
depends on its other operands, so the sweeps repeat until the set of values seen Partial stops
growing. Placeholders, constraints and outputs are fixed.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from compiler.constrain import decode
from compiler.reshard import cost, plan
from compiler.rules.notation import Rule, parse
from compiler.rules.registry import NO_EMPTY_BLOCKS, MissingRule, rule_for
from compiler.sharding import Axes, Sharding
from compiler.sources import source_of
from shardspec.errors import ShardingError, fail
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
    v = n.meta["val"]
    return int(v.numel()) if isinstance(v, torch.Tensor) else 0


def shape(n: Node) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def _replicate_rule(node: Node) -> tuple[Rule, list[Node]]:
    operands = [a for a in node.args if isinstance(a, Node)]
    toks = [[f"o{i}_{d}!" for d in range(len(shape(a)))] for i, a in enumerate(operands)]
    vals = node.meta["val"]
    outs = vals if isinstance(vals, (tuple, list)) else [vals]
    otoks = [[f"r{i}_{d}!" for d in range(v.dim())] for i, v in enumerate(outs)]
    from compiler.rules.notation import line

    return parse(line(toks, otoks), "none"), operands


class _Propagator:
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
        self.rules: dict[Node, tuple[Rule, list[Node]]] = {}
        self.partial_hint: set[Node] = set()  # values that ended Partial in the previous pass

    def rule(self, node: Node) -> tuple[Rule, list[Node]]:
        if node not in self.rules:
            try:
                self.rules[node] = rule_for(node)
            except MissingRule:
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
                self.result.notes.append(f"replicated fallback for {node.target} ({source_of(node)})")
        return self.rules[node]

    def constraint(self, node: Node) -> Sharding:
        """The sharding a ``constrain`` node pins, checked against the mesh."""
        spec = decode(str(node.kwargs["spec"]))
        where = source_of(node)
        if where.startswith("backward of "):
            where = where[len("backward of ") :]
        spec.validate(
            self.mesh, len(shape(node)), name=f"constrain at {where or node.name}", shape=shape(node)
        )
        return Sharding.of(spec, len(shape(node)))

    # ---- backward sweep: wants -------------------------------------------------------------
    def sweep_wants(self) -> None:
        nodes = list(self.graph.nodes)
        out = nodes[-1]
        for v, s in zip(out.args[0], self.out_specs, strict=True):
            if isinstance(v, Node):
                self.want.setdefault(v, s.dims)
        for node in reversed(nodes):
            if node.op != "call_function":
                continue
            if node.target is CONSTRAIN:
                fixed = self.constraint(node).dims
                self.want[node] = fixed
                self.want.setdefault(_node(node.args[0]), fixed)
                continue
            w = self.want.get(node)
            if w is None or node.target is operator.getitem:
                continue
            try:
                rule, operands = self.rule(node)
            except ShardingError:
                continue
            if len(rule.outputs) != 1 or len(rule.outputs[0]) != len(w) or rule.reductions:
                continue  # a contraction's output layout says nothing reliable about its operands
            fw = {
                dim[0]: axes for dim, axes in zip(rule.outputs[0], w, strict=True) if dim and axes is not None
            }
            for op, toks in zip(operands, rule.operands, strict=True):
                if op in self.want or len(toks) != len(shape(op)):
                    continue
                dims = tuple(fw.get(t[0]) if t and t[0] not in rule.minor else None for t in toks)
                flat = [a for d in dims if d for a in d]
                if len(flat) == len(set(flat)) and any(d is not None for d in dims):
                    self.want[op] = dims

    # ---- forward sweep ---------------------------------------------------------------------
    def run(self) -> Propagation:
        self.sweep_wants()
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        for n, s in zip(placeholders, self.inputs, strict=True):
            self.result.value[n] = s
        for node in self.graph.nodes:
            if node.op == "get_attr":
                self.result.value[node] = Sharding.replicated(len(shape(node)))
            elif node.op == "call_function":
                self.visit(node)
            elif node.op == "output":
                self.result.outputs = list(self.out_specs)
        return self.result

    def visit(self, node: Node) -> None:
        if node.target is CONSTRAIN:
            fixed = self.constraint(node)
            rule = parse(
                " ".join(f"c{i}" for i in range(len(fixed.dims)))
                + " -> "
                + " ".join(f"c{i}" for i in range(len(fixed.dims))),
                "none",
            )
            self.commit(node, OpPlan(rule, (node.args[0],), (fixed,), (fixed,), ()))  # type: ignore[arg-type]
            return
        if node.target is operator.getitem:
            src, idx = node.args
            self.result.value[node] = self.result.plans[src].outputs[idx]  # type: ignore[index]
            return
        rule, operands = self.rule(node)
        current = [self.result.value[o] for o in operands]
        for o, toks in zip(operands, rule.operands, strict=True):
            if len(toks) != len(shape(o)):
                raise AssertionError(f"rule {rule.text} does not fit {node.target} operand {shape(o)}")
        scored = [
            s
            for a in self.candidates(node, rule, operands, current)
            if (s := self.score(node, rule, operands, current, a)) is not None
        ]
        assert scored, f"no valid sharding for {node.target}"
        scored.sort(key=lambda s: s[0])
        best = scored[0]
        rival = next((s for s in scored[1:] if s[0][:2] == best[0][:2] and s[0][2] != best[0][2]), None)
        if rival is not None:
            self.ambiguous(node, best, rival)
        self.commit(node, best[1])

    def ambiguous(self, node: Node, best: tuple[Any, OpPlan], rival: tuple[Any, OpPlan]) -> None:
        """Equal bytes, different collectives, and nothing else decides: say so (strict: error)."""

        def show(p: OpPlan) -> str:
            return ", ".join(f"{f}={'x'.join(a) or '-'}" for f, a in p.assignment)

        text = (
            f"{str(node.target).replace('aten.', '')} at {source_of(node) or node.name}: splitting "
            f"{show(best[1])} ({best[0][2]} collective(s)) or {show(rival[1])} ({rival[0][2]}) sends "
            f"the same {best[0][1]:.0f} bytes; chose the first (fewer collectives)"
        )
        if self.strict:
            raise fail(
                f"ambiguous sharding: {text}.",
                "pin the intended layout with constrain(x, P(...)) on this value, or compile "
                "with strict=False to accept the choice.",
            )
        self.result.notes.append(text)

    def commit(self, node: Node, p: OpPlan) -> None:
        self.result.plans[node] = p
        self.result.value[node] = p.outputs[0] if len(p.outputs) == 1 else p.outputs  # type: ignore[assignment]
        for o, r in zip(p.operands, p.required, strict=True):
            self.memo.add((o, r))

    def candidates(
        self, node: Node, rule: Rule, operands: list[Node], current: list[Sharding]
    ) -> list[dict[str, Axes]]:
        options: dict[str, list[Axes]] = {f: [()] for f in rule.factors}
        for toks, s in zip(rule.operands, current, strict=True):
            for t, axes in zip(toks, s.dims, strict=True):
                if t and axes and axes not in options[t[0]]:
                    options[t[0]].append(axes)
        w = self.want.get(node)
        if w is not None and len(rule.outputs) == 1 and len(rule.outputs[0]) == len(w):
            for t, want_axes in zip(rule.outputs[0], w, strict=True):
                if t and want_axes and want_axes not in options[t[0]]:
                    options[t[0]].append(want_axes)
        for f in rule.replicated | rule.minor:
            options[f] = [()]
        names = list(options)
        combos = itertools.product(*(options[f] for f in names))
        out = []
        for combo in itertools.islice(combos, 4096):
            flat = [a for axes in combo for a in axes]
            if len(flat) == len(set(flat)):
                out.append(dict(zip(names, combo, strict=True)))
        return out

    def score(
        self, node: Node, rule: Rule, operands: list[Node], current: list[Sharding], a: dict[str, Axes]
    ) -> tuple[Any, OpPlan] | None:
        sizes = self.factor_sizes(rule, operands, node)
        no_empty = set(rule.factors) if node.target in NO_EMPTY_BLOCKS else rule.reductions
        for f in no_empty:  # some kernels (convolution, and any sum over nothing) reject empty blocks
            if a[f] and sizes.get(f, 0) < self.mesh.axis_size(a[f]):
                return None
        for dims in (*rule.operands, *rule.outputs):
            for t in dims:
                if len(t) > 1 and a[t[0]] and sizes.get(t[0], 0) % self.mesh.axis_size(a[t[0]]):
                    return None  # an uneven split cannot pass through a merged/split dim
        used = {x for axes in a.values() for x in axes}
        keep = self.kept_partials(node, rule, operands, current, used)
        required = tuple(
            Sharding(tuple(a[t[0]] if t else () for t in toks), keep.get(i, ()))
            for i, toks in enumerate(rule.operands)
        )
        carried = next(iter(keep.values()), ())
        reduced = [x for f in rule.reductions if f not in rule.replicated for x in a[f]]
        partial = tuple(x for x in self.mesh.axis_names if x in set(carried) | set(reduced))
        outputs = tuple(Sharding(tuple(a[t[0]] if t else () for t in dims), partial) for dims in rule.outputs)
        nbytes, ncoll, penalty, reused = 0.0, 0, 0, 0
        for o, s, r in zip(operands, current, required, strict=True):
            if s != r and (o, r) in self.memo:
                reused += 1  # an earlier op already paid to move this value here
            elif (o, r) not in self.memo:
                steps = plan(shape(o), o.meta["val"].dtype, s, r, self.mesh)
                b, c = cost(steps)
                moves = cost([st for st in steps if st.kind in ("all_gather", "all_to_all")])[0]
                if s.dims != r.dims and not self.param_like(o):
                    # moving a computed value to another layout usually means moving it back later
                    # (the residual stream, backward): price the round trip
                    b += moves
                elif s.dims != r.dims:
                    # a gathered parameter serves forward and backward alike (reused, not
                    # re-gathered): each use carries half
                    b -= moves / 2
                nbytes, ncoll = nbytes + b, ncoll + c
        for f in rule.reductions:
            if a[f] and any(
                t and t[0] == f and s.dims[k] != a[f]
                for toks, s in zip(rule.operands, current, strict=True)
                for k, t in enumerate(toks)
            ):
                penalty += 1
        target = self.want_target(node, outputs)
        if target is not None:
            b, c = cost(plan(shape(node), node.meta["val"].dtype, outputs[0], target, self.mesh))
            nbytes, ncoll = nbytes + b, ncoll + c
        nsplit = sum(1 for axes in a.values() if axes)
        p = OpPlan(rule, tuple(operands), required, outputs, tuple(sorted(a.items())))
        return (penalty, nbytes, ncoll, -reused, -nsplit), p

    def want_target(self, node: Node, outputs: tuple[Sharding, ...]) -> Sharding | None:
        """The output's want merged with the candidate where the want has no preference."""
        w = self.want.get(node) or self.consumer_hint(node)
        if w is None or len(outputs) != 1 or len(w) != len(outputs[0].dims):
            return None
        dims = [axes if axes is not None else () for axes in w]
        taken = {a for d in dims for a in d}
        for k, axes in enumerate(w):
            if axes is None and not taken & set(outputs[0].dims[k]):
                dims[k] = outputs[0].dims[k]
                taken |= set(dims[k])
        return Sharding(tuple(dims))

    def param_like(self, node: Node) -> bool:
        """An input, or a view / transpose / cast / copy of one (a weight's ``.t()`` included)."""
        if node.op in ("placeholder", "get_attr"):
            return True
        if node.op != "call_function" or node.target not in _VIEW_LIKE:
            return False
        srcs = [a for a in node.args if isinstance(a, Node)]
        return len(srcs) == 1 and self.param_like(srcs[0])

    def consumer_hint(self, node: Node, depth: int = 0) -> Want | None:
        """A few steps of lookahead: the layout that a consumer's already-placed operands imply for
        this value (the residual stream tells an attention output which way to come out). Computed
        values speak first; parameters (placeholders) are weak evidence, since they are often
        gathered anyway, so past them the consumer's own consumers are asked."""
        for user in node.users:
            if user.op != "call_function" or user.target in (CONSTRAIN, operator.getitem):
                continue
            try:
                rule, operands = self.rule(user)
            except ShardingError:
                continue
            if node not in operands or len(rule.outputs) != 1:
                continue
            factors: dict[str, Axes] = {}
            for o, toks in zip(operands, rule.operands, strict=True):
                s = self.result.value.get(o) if o is not node and o.op != "placeholder" else None
                if isinstance(s, Sharding) and len(s.dims) == len(toks):
                    for t, axes in zip(toks, s.dims, strict=True):
                        if t and axes and t[0] not in rule.reductions:
                            factors.setdefault(t[0], axes)
            if not factors and depth < 3 and not rule.reductions:
                later = self.consumer_hint(user, depth + 1)
                if later is not None and len(later) == len(rule.outputs[0]):
                    factors = {
                        t[0]: axes for t, axes in zip(rule.outputs[0], later, strict=True) if t and axes
                    }
            if not factors:
                continue
            toks = rule.operands[operands.index(node)]
            dims = tuple(factors.get(t[0]) if t else None for t in toks)
            flat = [x for d in dims if d for x in d]
            if any(d is not None for d in dims) and len(flat) == len(set(flat)):
                return dims
        return None

    def factor_sizes(self, rule: Rule, operands: list[Node], node: Node) -> dict[str, int]:
        sizes: dict[str, int] = {}
        vals = node.meta["val"]
        outs = vals if isinstance(vals, (tuple, list)) else [vals]
        for toks, shp in [
            *zip(rule.operands, (shape(o) for o in operands), strict=True),
            *zip(rule.outputs, (tuple(v.shape) for v in outs), strict=True),
        ]:
            for t, n in zip(toks, shp, strict=True):
                if len(t) == 1:
                    sizes[t[0]] = n
        return sizes

    def kept_partials(
        self, node: Node, rule: Rule, operands: list[Node], current: list[Sharding], used: set[str]
    ) -> dict[int, Axes]:
        """Which operands stay Partial through this op (the rest get reduced first)."""
        partial = [i for i, s in enumerate(current) if s.partial]
        if not partial or rule.linear == "none":
            return {}
        reduced = {o for (o, r) in self.memo if not r.partial}  # already reduced: reuse that
        ok = [
            i
            for i in partial
            if not used & set(current[i].partial)
            and operands[i] not in reduced
            and not self.must_reduce_now(operands[i], node)
        ]
        if rule.linear == "all":
            axes = {current[i].partial for i in range(len(current))}
            if len(ok) == len(current) and len(axes) == 1:
                return {i: current[i].partial for i in ok}
            return {}
        if len(partial) != 1 or len(ok) != 1 or operands.count(operands[ok[0]]) > 1:
            return {}
        if (rule.linear == "first" and ok[0] != 0) or (rule.linear == "last" and ok[0] != len(operands) - 1):
            return {}
        if _numel(node) > _numel(operands[ok[0]]):
            return {}  # the pending sum would grow: reducing the operand now sends fewer bytes
        return {ok[0]: current[ok[0]].partial}

    def must_reduce_now(self, value: Node, consumer: Node) -> bool:
        """True when another consumer of ``value`` cannot take it Partial: reduce once, here."""
        for user in value.users:
            if user is consumer:
                continue
            if user.op == "output" or user.target is CONSTRAIN:
                return True
            try:
                rule, operands = self.rule(user)
            except ShardingError:
                return True
            if rule.linear == "none" or operands.count(value) > 1:
                return True
            if rule.linear == "first" and operands[0] is not value:
                return True
            if rule.linear == "last" and operands[-1] is not value:
                return True
            others = [o for o in operands if o is not value]
            if rule.linear in ("one", "first", "last") and any(o in self.partial_hint for o in others):
                return True
            if rule.linear == "all" and not all(o in self.partial_hint for o in others):
                return True
        return False


def propagate(
    graph: torch.fx.Graph,
    inputs: list[Sharding],
    outputs: list[Sharding],
    mesh: Mesh,
    unsupported: str = "error",
    max_passes: int = 4,
    strict: bool = False,
) -> Propagation:
    """Shardings for every value of ``graph`` given fixed input and output shardings.

    Repeats the sweeps until the set of values seen Partial stops growing: whether a consumer can
    take a pending sum depends on whether its other operands may be pending too. The set only
    grows, so the passes converge.
    """
    hint: set[Node] = set()
    for _ in range(max_passes):
        p = _Propagator(graph, inputs, outputs, mesh, unsupported, strict)
        p.partial_hint = hint
        result = p.run()
        now = hint | {n for n, s in result.value.items() if isinstance(s, Sharding) and s.partial}
        if now == hint:
            break
        hint = now
    return result
