"""Sinking: a reduction whose result some op needs in the middle of backward (a pending sum that an
op before the optimizer must see whole, such as GPT's position-embedding gradient before its
slice-scatter) would split the gradient buckets in two: the bucket it joins must be issued before
that op, so gradients ready after it need another launch. When nothing the other reductions wait on
depends on that op, the op (and everything computed from it) can run after the last gradient is
ready instead, and every reduction of the kind fits one stream of buckets, as in DDP.

Moving ops later never breaks an input; the moved cone is closed under users and keeps its order.
"""

from __future__ import annotations

from typing import Any

from torch.fx import GraphModule, Node

from compiler.passes.bucketing import candidate
from compiler.passes.graph import copy_module


def sink(gm: GraphModule) -> GraphModule:
    """Delay the early users of bucketable collectives past the last input of their kind."""
    gm = copy_module(gm)
    sink_(gm)
    gm.recompile()
    return gm


def sink_(gm: GraphModule) -> None:
    by_key: dict[tuple[Any, ...], list[Node]] = {}
    for n in gm.graph.nodes:
        key = candidate(n)
        if key is not None and key[0] != "all_gather":  # reductions only: gathers feed compute
            by_key.setdefault(key, []).append(n)
    for members in by_key.values():
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        inputs = [m.args[0] for m in members if isinstance(m.args[0], Node)]
        last = max(inputs, key=pos.__getitem__, default=None)
        if last is None or last.op == "placeholder":
            continue
        for m in members:
            if min(pos[u] for u in m.users) < pos[last]:
                _sink_cone(gm, m, last, set(inputs))
                pos = {n: i for i, n in enumerate(gm.graph.nodes)}


def _sink_cone(gm: GraphModule, c: Node, anchor: Node, keep: set[Node]) -> None:
    """Move every op computed from ``c``'s result that runs before ``anchor`` to right after it,
    unless one of them feeds a node in ``keep``."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    cone: set[Node] = set()
    todo = list(c.users)
    while todo:
        n = todo.pop()
        if n in cone or n.op == "output":
            continue
        if n in keep or n is anchor:
            return  # another reduction's input depends on it: it cannot wait
        cone.add(n)
        todo.extend(n.users)
    moved = sorted((n for n in cone if pos[n] < pos[anchor]), key=pos.__getitem__)
    if all(u in cone or u.op == "output" for n in cone for u in n.users):
        # only results read it (the loss): the whole cone can wait for the very end, keeping the
        # reduction's first use there, so the reduction may share the last gradient bucket
        moved = sorted(cone, key=pos.__getitem__)
        anchor = next(n for n in reversed(gm.graph.nodes) if n.op == "output").prev
    for n in moved:
        anchor.append(n)
        anchor = n
