"""Remat: recompute a ``shardspec.remat`` region's forward values in backward instead of keeping them.

Each forward op of a per-rank program whose traced op ran inside ``remat(fn)`` belongs to that call's
region (``regions``: traced name -> (region, kept by the policy)). Ops the partitioner inserted
for the region (a ZeRO-3 parameter gather, a reduction inside the layer, a multi-result op's
items) belong to it too when all their inputs do or are program inputs. For each region, the
values backward reads are recomputed by copies of the ops that make them, placed just before the
first backward op reading one of them; backward then reads the copies, so the originals die after
their last forward use and only the region's inputs (and the policy's saved values) live across
the forward/backward gap. A value another region's recomputation keeps anyway (a layer's output
is the next layer's input) is not recomputed.

Collectives are copied too: a parameter gather in the region is issued again in backward (and
backward's own reads of that parameter use the copy, so with ``regather`` it is still gathered
twice per step, not three times); the copies are reported as launches ``<gather>@remat``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import LAUNCHES, copy_module
from compiler.passes.regather import BACKWARD, REGATHER

ops = torch.ops.shardspec
REMAT = "shardspec_remat"  # node meta: a recomputed copy
AGAIN = "@remat"  # a launch member named "<collective>@remat" is that collective recomputed
ORIGIN = "shardspec_origin"
Regions = Mapping[str, tuple[int, bool]]
_P2P = (ops.send.default, ops.recv.default)


def remat(gm: GraphModule, regions: Regions) -> GraphModule:
    """The program with each remat region recomputed for backward (see the module doc)."""
    gm = copy_module(gm)
    remat_(gm, regions)
    gm.recompile()
    return gm


def remat_(gm: GraphModule, regions: Regions) -> None:
    if not regions:
        return
    graph = gm.graph
    member, saved = _members(gm, regions)
    ids = sorted(set(member.values()))
    plans = {r: _plan(gm, member, saved, r, frozenset()) for r in ids}
    kept: frozenset[Node] = frozenset().union(*(k for _, _, k in plans.values()))
    for r in ids:
        needed, todo, _ = _plan(gm, member, saved, r, kept)
        if needed:
            _recompute(gm, needed, todo, member)
    graph.lint()


def _members(gm: GraphModule, regions: Regions) -> tuple[dict[Node, int], set[Node]]:
    """Forward node -> region id (inserted ops join the region of their inputs), and the kept ones."""
    member: dict[Node, int] = {}
    saved: set[Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get(BACKWARD):
            continue
        origin = n.meta.get(ORIGIN)
        if origin is not None:
            if origin in regions:
                member[n], keep = regions[origin]
                if keep:
                    saved.add(n)
            continue
        inputs = [a for a in n.all_input_nodes if a.op not in ("placeholder", "get_attr")]
        found = {member.get(a) for a in inputs}
        if inputs and len(found) == 1 and None not in found:
            member[n] = found.pop()  # type: ignore[assignment]
    return member, saved


def _is_backward(u: Node, seen: dict[Node, bool]) -> bool:
    """A backward op, or an inserted op (no traced origin) feeding only backward ops. ``seen``
    memoizes, and starts with the region members (forward values: False)."""
    if u not in seen:
        seen[u] = False
        if u.meta.get(BACKWARD):
            seen[u] = True
        elif u.op == "call_function" and u.meta.get(ORIGIN) is None:
            seen[u] = bool(u.users) and all(_is_backward(x, seen) for x in u.users)
    return seen[u]


def _plan(
    gm: GraphModule, member: dict[Node, int], saved: set[Node], r: int, kept: frozenset[Node]
) -> tuple[list[Node], list[Node], frozenset[Node]]:
    """Region ``r``'s values backward reads, the ops recomputing them (program order), and the
    values those ops read from outside (kept alive until then)."""
    seen = dict.fromkeys(member, False)
    needed = [
        n
        for n in gm.graph.nodes
        if member.get(n) == r
        and n not in saved
        and n not in kept
        and any(_is_backward(u, seen) for u in n.users)
    ]
    todo: set[Node] = set()
    outside: set[Node] = set()
    stack = list(needed)
    while stack:
        n = stack.pop()
        if n in todo:
            continue
        todo.add(n)
        for a in n.all_input_nodes:
            if _recomputable(a, member, saved, r):
                stack.append(a)
            elif a.op != "placeholder" and a.op != "get_attr":
                outside.add(a)
    order = [n for n in gm.graph.nodes if n in todo]
    return needed, order, frozenset(outside)


def _recomputable(a: Node, member: dict[Node, int], saved: set[Node], r: int) -> bool:
    if a in member:
        return member[a] == r and a not in saved
    if a.op != "call_function" or a.meta.get(ORIGIN) is not None or a.meta.get(BACKWARD):
        return False
    if a.target in _P2P:  # a stage's send or recv pairs with one op on its peer: never repeated
        return False
    # an inserted op on program inputs only (a parameter gather, and views of it)
    return all(
        x.op in ("placeholder", "get_attr") or _recomputable(x, member, saved, r) for x in a.all_input_nodes
    )


def _recompute(gm: GraphModule, needed: list[Node], todo: list[Node], member: dict[Node, int]) -> None:
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    seen = dict.fromkeys(member, False)
    first = min((u for n in needed for u in n.users if _is_backward(u, seen)), key=pos.__getitem__)
    copies: dict[Node, Node] = {}
    with graph.inserting_before(first):
        for n in todo:
            c = graph.node_copy(n, lambda a: copies.get(a, a))
            c.meta = {**n.meta, BACKWARD: True, REMAT: True}
            if n.target in LAUNCHES:
                c.meta["shardspec_members"] = [n.name + AGAIN]
                if n.target is ops.all_gather.default:
                    c.meta[REGATHER] = True  # bucketed with backward's gathers
            copies[n] = c
    for n in todo:
        for u in list(n.users):
            if u not in copies.values() and pos.get(u, -1) >= pos[first] and _is_backward(u, seen):
                u.replace_input_with(n, copies[n])
    for n in reversed(todo):
        c = copies[n]
        if not c.users:
            graph.erase_node(c)
        if not n.users:
            graph.erase_node(n)
