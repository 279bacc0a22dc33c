"""Per-op candidate plans for the global planner.

Each candidate is an ``OpPlan`` built the way propagation builds its own: every factor of the op's
rule takes one set of mesh axes (none, or axes some candidate of an operand already splits that
factor's dims by, or the output's want), and a linear op may keep a pending-sum operand pending
(its Partial axes carried to the output). The candidates are enumerated forward, from the states
every candidate of each producer can leave, so the planner can pick a consistent whole-graph plan
that greedy propagation never looked at (keep the batch split where greedy gathered it).
"""

from __future__ import annotations

import itertools

import torch
from torch.fx import Node

from compiler.propagate_state import _VIEW_LIKE, OpPlan, factor_sizes
from compiler.rules.notation import Rule
from compiler.rules.registry import NO_EMPTY_BLOCKS
from compiler.sharding import Axes, Sharding
from shardspec.layout import chunk_sizes
from shardspec.mesh import Mesh

VIEWS = _VIEW_LIKE


def _ordered(axes: set[str], mesh: Mesh) -> Axes:
    return tuple(a for a in mesh.axis_names if a in axes)


def _valid(node: Node, rule: Rule, sizes: dict[str, int], a: dict[str, Axes], mesh: Mesh) -> bool:
    no_empty = set(rule.factors) if node.target in NO_EMPTY_BLOCKS else rule.reductions
    for f in no_empty:
        if a[f] and min(chunk_sizes(sizes.get(f, 0), mesh.axis_size(a[f]))) == 0:
            return False
    for dims in (*rule.operands, *rule.outputs):
        for t in dims:
            if len(t) > 1 and a[t[0]] and sizes.get(t[0], 0) % mesh.axis_size(a[t[0]]):
                return False
    return True


def _keeps(rule: Rule, operands: list[Node], states: list[list[Sharding]]) -> list[dict[int, Axes]]:
    """Which operands may stay pending (and over which axes), per the rule's linearity."""
    out: list[dict[int, Axes]] = [{}]
    pend = [sorted({s.partial for s in st if s.partial}) for st in states]
    if rule.linear == "none" or not any(pend):
        return out
    if rule.linear == "all":
        common = set(pend[0]).intersection(*map(set, pend[1:])) if pend else set()
        out += [dict.fromkeys(range(len(operands)), p) for p in sorted(common)]
        return out
    for i, options in enumerate(pend):
        if operands.count(operands[i]) > 1:
            continue
        if (rule.linear == "first" and i != 0) or (rule.linear == "last" and i != len(operands) - 1):
            continue
        out += [{i: p} for p in options]
    return out


def candidates(
    node: Node,
    rule: Rule,
    operands: list[Node],
    states: list[list[Sharding]],
    want: tuple[Axes | None, ...] | None,
    greedy: OpPlan,
    mesh: Mesh,
    cap: int,
) -> list[OpPlan]:
    """Up to ``cap`` distinct plans for ``node`` (greedy's first), most-split assignments first."""
    options: dict[str, list[Axes]] = {f: [()] for f in rule.factors}
    for toks, st in zip(rule.operands, states, strict=True):
        for s in st:
            for t, axes in zip(toks, s.dims, strict=False):
                if t and axes and axes not in options[t[0]]:
                    options[t[0]].append(axes)
    for f, axes in greedy.assignment:
        if axes and f in options and axes not in options[f]:
            options[f].append(axes)
    if want is not None and len(rule.outputs) == 1 and len(rule.outputs[0]) == len(want):
        for t, w in zip(rule.outputs[0], want, strict=True):
            if t and w and w not in options[t[0]]:
                options[t[0]].append(w)
    for f in rule.replicated | rule.minor:
        options[f] = [()]
    names = list(options)
    sizes = factor_sizes(rule, operands, node)
    combos = []
    for combo in itertools.islice(itertools.product(*(options[f] for f in names)), 4096):
        flat = [x for axes in combo for x in axes]
        if len(flat) == len(set(flat)):
            a = dict(zip(names, combo, strict=True))
            if _valid(node, rule, sizes, a, mesh):
                combos.append(a)
    combos.sort(key=lambda a: -sum(1 for v in a.values() if v))  # stable: deterministic
    keeps = _keeps(rule, operands, states)
    out: list[OpPlan] = [greedy]
    seen = {(greedy.required, greedy.outputs)}
    for a in combos:
        used = {x for axes in a.values() for x in axes}
        for keep in keeps:
            if any(used & set(p) for p in keep.values()):
                continue
            required = tuple(
                Sharding(tuple(a[t[0]] if t else () for t in toks), keep.get(i, ()))
                for i, toks in enumerate(rule.operands)
            )
            carried = next(iter(keep.values()), ())
            reduced = [x for f in rule.reductions if f not in rule.replicated for x in a[f]]
            partial = _ordered(set(carried) | set(reduced), mesh)
            outputs = tuple(Sharding(tuple(a[t[0]] if t else () for t in d), partial) for d in rule.outputs)
            if (required, outputs) in seen:
                continue
            seen.add((required, outputs))
            out.append(OpPlan(rule, tuple(operands), required, outputs, tuple(sorted(a.items()))))
            if len(out) >= cap:
                return out
    return out


def follow(
    node: Node, rule: Rule, operands: list[Node], states: list[list[Sharding]], mesh: Mesh
) -> list[OpPlan] | None:
    """Merge a simple op into its producer: one plan per state of its single operand, each keeping
    that state as it is (a view, a cast, a unary elementwise op: nothing to choose but what its
    producer chose, so the integer program needs no variables for it). None where some state
    cannot pass through unchanged (a split on a dim the op merges or keeps whole, a pending sum
    the op is not linear in or would enlarge): the op then gets candidates of its own."""
    if len(operands) != 1 or len(rule.outputs) != 1 or rule.reductions or len(states[0]) < 2:
        return None
    sizes = factor_sizes(rule, operands, node)
    toks = rule.operands[0]
    blocked = rule.replicated | rule.minor
    grows = _numel(node) > _numel(operands[0])
    plans = []
    for s in states[0]:
        a: dict[str, Axes] = dict.fromkeys(rule.factors, ())
        for t, axes in zip(toks, s.dims, strict=True):
            if axes:
                if not t or t[0] in blocked or a[t[0]]:
                    return None
                a[t[0]] = axes
        if not _valid(node, rule, sizes, a, mesh):
            return None
        if s.partial and (rule.linear == "none" or grows):
            return None
        required = Sharding(tuple(a[t[0]] if t else () for t in toks), s.partial)
        if required != s:
            return None
        outputs = (Sharding(tuple(a[t[0]] if t else () for t in rule.outputs[0]), s.partial),)
        plans.append(OpPlan(rule, tuple(operands), (required,), outputs, tuple(sorted(a.items()))))
    return plans


def _numel(n: Node) -> int:
    v = n.meta.get("val")
    return int(v.numel()) if isinstance(v, torch.Tensor) else 0
