"""Donation, as ``jax.jit(donate_argnums=...)``: a functional optimizer returns new parameters and
moments beside the old ones, so a step holds its model state twice at its end. When the caller
gives up the old values (``sharded(..., donate=(0, 1))``), each result is written into a donated
input buffer of the same local shape and dtype (``copy_``) as soon as both the result exists and
nothing reads that input any more, and the program returns that buffer: the new value's own buffer
dies right after, as a torch optimizer's in-place update would leave it.

Runs last, on the scheduled program; the copy is the only mutation, of inputs only.
"""

from __future__ import annotations

import heapq
import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from compiler.passes.graph import alias_source, aliases_input

aten = torch.ops.aten
ops = torch.ops.shardspec


def donate_(
    gm: GraphModule, donated: Sequence[int], in_paths: Sequence[str], out_paths: Sequence[str]
) -> None:
    """Write results into the donated placeholders (indices into the program's inputs)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    taken = _adamw_in_place(graph, {placeholders[i] for i in donated})
    nodes = list(graph.nodes)
    pos, root, last = _last_reads(graph)
    output = nodes[-1]
    results = list(output.args[0])
    free = [placeholders[i] for i in donated if placeholders[i] not in taken]
    for i, v in enumerate(results):
        if not isinstance(v, Node) or root[v].op == "placeholder":
            continue  # a result that is (a view of) an input keeps that buffer
        want = v.meta.get("val")
        while v.target is aten.contiguous.default:  # copy_ densifies: copy as soon as the value exists
            v = v.args[0]
        if v not in pos:  # a copy_ made above: this result is one already donated (``return c, c``)
            results[i] = v
            continue
        fits = [p for p in free if _same_layout(p.meta.get("val"), want)]
        if not fits:
            continue
        target = max(fits, key=lambda p: _common_suffix(in_paths[placeholders.index(p)], out_paths[i]))
        free.remove(target)
        after = max(pos[v], last.get(target, pos[target]))
        anchor = nodes[after]
        with graph.inserting_after(anchor):
            copied = graph.call_function(aten.copy_.default, (target, v))
        copied.meta["val"] = target.meta.get("val")
        copied.meta["shardspec_donated"] = in_paths[placeholders.index(target)]
        for u in [u for u in v.users if u is not copied and pos.get(u, -1) > after]:
            u.replace_input_with(v, copied)  # later reads take the donated buffer: ``v`` dies here
        old, results[i] = results[i], copied
        while isinstance(old, Node) and old.op == "call_function" and not old.users and old is not v:
            src = old.args[0]
            if any(r is old for r in results):
                break
            graph.erase_node(old)  # the contiguous() that used to hold the result until the end
            old = src
    output.args = (tuple(results),)
    graph.lint()
    gm.recompile()


def _last_reads(graph: Graph) -> tuple[dict[Node, int], dict[Node, Node], dict[Node, int]]:
    """Each node's position, the buffer it is (a view of), and the last position reading each
    buffer (through views, and until the wait of an async collective reading it)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root: dict[Node, Node] = {}
    for n in nodes:
        src = alias_source(n)
        alias = n.op == "call_function" and src is not None and aliases_input(n)
        root[n] = root[src] if alias and src is not None else n
    last: dict[Node, int] = {}
    for n in nodes:
        done = max((pos[u] for u in n.users), default=pos[n]) if n.kwargs.get("async_op") else pos[n]
        for a in n.all_input_nodes:
            last[root[a]] = max(last.get(root[a], -1), pos[n], done)
    return pos, root, last


def _adamw_in_place(graph: Graph, donated: set[Node]) -> set[Node]:
    """The ``adamw`` updates (one node per parameter, as traced) whose parameter and both moments
    are donated inputs nothing reads after the update become one ``adamw_multi_`` node that writes
    them in place (torch's fused multi-tensor kernel), placed where the last of them was: no fresh
    buffers, no copy back. Later reads of their results read those inputs, after that node. The
    other updates stay functional. Returns the inputs taken."""
    pos, _, last = _last_reads(graph)
    groups: dict[tuple[Any, ...], list[Node]] = {}
    taken: set[Node] = set()
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not ops.adamw.default or n.kwargs:
            continue
        p, _, m, v = n.args[:4]
        buffers = (p, m, v)
        free = all(b in donated and b not in taken and _dense(b) for b in buffers)
        if (
            free
            and len(set(buffers)) == 3
            and all(last.get(b, -1) <= pos[n] for b in buffers)  # read last by the update itself
            and all(u.target is operator.getitem for u in n.users)
        ):
            taken.update(buffers)
            groups.setdefault(tuple(n.args[4:]), []).append(n)
    after: dict[Node, list[Node]] = {}  # node -> nodes that must come after it (reads of the update)
    for members in groups.values():
        end = max(members, key=pos.__getitem__)
        lists = tuple([n.args[k] for n in members] for k in range(4))
        with graph.inserting_after(end):
            update = graph.call_function(ops.adamw_multi_.default, (*lists, *members[0].args[4:]))
        update.meta["val"] = None
        for n in members:
            for u in list(n.users):
                buffer = n.args[(0, 2, 3)[int(u.args[1])]]  # type: ignore[arg-type]
                after.setdefault(update, []).extend(u.users)
                u.replace_all_uses_with(buffer)  # type: ignore[arg-type]
                graph.erase_node(u)
            graph.erase_node(n)
    for b in taken:  # an updated buffer is returned as it lies (copy_ targets are too)
        for u in list(b.users):
            if u.target is aten.contiguous.default and all(x.op == "output" for x in u.users):
                u.replace_all_uses_with(b)
                graph.erase_node(u)
    if after:
        _reorder(graph, after)
    return taken


def _reorder(graph: Graph, after: dict[Node, list[Node]]) -> None:
    """A stable topological order over the data edges plus ``after``: a node keeps its place
    unless something it must follow now comes later; then it follows that (every rank's program
    moves the same nodes, so collectives stay in one order)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    follows: dict[Node, set[Node]] = {n: set(n.all_input_nodes) for n in nodes}
    for first, later in after.items():
        for n in later:
            if n in follows:  # (not erased since)
                follows[n].add(first)
    users: dict[Node, list[Node]] = {n: [] for n in nodes}
    for n, before in follows.items():
        for b in before:
            users[b].append(n)
    waiting = {n: len(b) for n, b in follows.items()}
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, index[u])
    assert len(order) == len(nodes), "a cycle after fusing the AdamW updates"
    if order != nodes:
        anchor = order[0]
        for n in order[1:]:
            anchor.append(n)
            anchor = n


def _dense(n: Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_contiguous()


def _same_layout(a: object, b: object) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.is_contiguous()
    )


def _common_suffix(a: str, b: str) -> int:
    """How much of two leaf paths agrees from the end: ``params['w1']`` fits ``[0]['w1']`` best."""
    x, y = re.findall(r"\[[^\]]*\]", a), re.findall(r"\[[^\]]*\]", b)
    n = 0
    while n < min(len(x), len(y)) and x[-1 - n] == y[-1 - n]:
        n += 1
    return n
