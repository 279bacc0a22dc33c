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
from typing import Any

import torch
from torch.fx import Node

from compiler.lookahead import Lookahead
from compiler.pending import PendingSums
from compiler.propagate_state import (
    CONSTRAIN,
    OpPlan,
    Propagation,
    Want,
    factor_sizes,
    shape,
)
from compiler.reshard import Step, cost, plan
from compiler.rules.notation import Rule, parse
from compiler.rules.registry import NO_EMPTY_BLOCKS
from compiler.sharding import Axes, Sharding
from compiler.sources import source_of
from shardspec.errors import fail
from shardspec.layout import chunk_sizes
from shardspec.mesh import Mesh

__all__ = ["CONSTRAIN", "OpPlan", "Propagation", "propagate", "shape"]


class _Propagator(Lookahead, PendingSums):
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
        sizes = factor_sizes(rule, operands, node)
        hint = self.want.get(node) or self.consumer_hint(node)  # the same for every candidate
        scored = [
            s
            for a in self.candidates(node, rule, operands, current, hint)
            if (s := self.score(node, rule, operands, current, a, sizes, hint)) is not None
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
            if (o, r) not in self.memo:
                self.memo.add((o, r))
                self.moved.setdefault(o, []).append(r)

    def candidates(
        self, node: Node, rule: Rule, operands: list[Node], current: list[Sharding], hint: Want | None = None
    ) -> list[dict[str, Axes]]:
        options: dict[str, list[Axes]] = {f: [()] for f in rule.factors}
        for o, toks, s in zip(operands, rule.operands, current, strict=True):
            # a pending operand already reduced for another consumer: its reduced layout too, so
            # this op can reuse that reduction (layer norm's bias gradient summing the
            # reduce-scattered gradient instead of all-reducing it whole)
            reduced = [r for r in self.moved.get(o, ()) if not r.partial] if s.partial else []
            for held in (s, *reduced):
                for t, axes in zip(toks, held.dims, strict=True):
                    if t and axes and axes not in options[t[0]]:
                        options[t[0]].append(axes)
        w = self.want.get(node)
        if w is None and rule.linear == "none" and any(s.partial for s in current):
            # a pending sum reduced here may be reduce-scattered into the layout its consumer
            # wants (a gradient cast before its sharded update) rather than all-reduced whole
            w = hint
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
        self,
        node: Node,
        rule: Rule,
        operands: list[Node],
        current: list[Sharding],
        a: dict[str, Axes],
        sizes: dict[str, int],
        hint: Want | None,
    ) -> tuple[Any, OpPlan] | None:
        no_empty = set(rule.factors) if node.target in NO_EMPTY_BLOCKS else rule.reductions
        for f in no_empty:  # some kernels (convolution, and any sum over nothing) reject empty blocks
            if a[f] and min(chunk_sizes(sizes.get(f, 0), self.mesh.axis_size(a[f]))) == 0:
                return None  # torch.chunk leaves some rank an empty block (4 over 3: 2, 2, 0)
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
                steps = self.plan(o, s, r)
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
        for f in rule.reductions:  # a layout memo already holds (a reduction reused) is no reshard
            if a[f] and any(
                t and t[0] == f and s.dims[k] != a[f] and (o, r) not in self.memo
                for o, toks, s, r in zip(operands, rule.operands, current, required, strict=True)
                for k, t in enumerate(toks)
            ):
                penalty += 1
        target = self.want_target(hint, outputs)
        if target is not None:
            b, c = cost(self.plan(node, outputs[0], target))
            nbytes, ncoll = nbytes + b, ncoll + c
        nsplit = sum(1 for axes in a.values() if axes)
        p = OpPlan(rule, tuple(operands), required, outputs, tuple(sorted(a.items())))
        return (penalty, nbytes, ncoll, -reused, -nsplit), p

    def plan(self, value: Node, src: Sharding, dst: Sharding) -> list[Step]:
        """The collectives moving ``value`` from ``src`` to ``dst`` (remembered: repeated layers ask
        the same question for every candidate of every layer)."""
        key = (shape(value), value.meta["val"].dtype, src, dst)
        steps = self.plans.get(key)
        if steps is None:
            steps = self.plans[key] = list(plan(key[0], key[1], src, dst, self.mesh))
        return steps


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
    rules: dict[Node, Any] = {}  # what the hint cannot change, shared by the passes: each op's
    plans: dict[tuple[Any, ...], list[Step]] = {}  # registered rule, and the collectives of a move
    for _ in range(max_passes):
        p = _Propagator(graph, inputs, outputs, mesh, unsupported, strict)
        p.partial_hint, p.rules, p.plans = hint, dict(rules), plans
        result = p.run()
        rules = {n: r for n, r in p.rules.items() if n not in p.fallbacks}  # (each pass notes those)
        now = hint | {n for n, s in result.value.items() if isinstance(s, Sharding) and s.partial}
        if now == hint:
            break
        hint = now
    return result
