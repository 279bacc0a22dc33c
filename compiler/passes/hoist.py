"""Hoisting: a reduction of a small value computed from the program's inputs alone (cross-entropy's
count of counted targets, read from the batch) is traced where the user's code computed it, at the
end of forward, so its all-reduce would be issued there and waited for a few ops later, at the start
of backward: a blocking rendezvous of the ranks in the middle of the step. Computed at the program's
start instead (a few cheap ops), it is issued there and completes while forward runs, and bucketing
need not pair it with the reductions ready only at the end of forward.

Only short cones are moved (``MAX_CONE`` ops): a long one is real compute (a whole forward also
depends on inputs alone), which stays where it is. Moving ops earlier never breaks an input: the
cone's own inputs are program inputs, and it keeps its order.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from compiler.passes.bucketing import candidate
from compiler.passes.graph import copy_module, mutates

MAX_CONE = 8


def hoist(gm: GraphModule) -> GraphModule:
    """Move the short input-only cones of bucketable reductions to the program's start."""
    gm = copy_module(gm)
    hoist_(gm)
    gm.recompile()
    return gm


def hoist_(gm: GraphModule) -> None:
    graph = gm.graph
    anchor = None
    for n in graph.nodes:
        if n.op == "placeholder":
            anchor = n
    if anchor is None:
        return
    for c in [n for n in graph.nodes if (key := candidate(n)) is not None and key[0] != "all_gather"]:
        cone = _input_cone(c.args[0])
        if cone is None:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        for n in sorted(cone, key=order.__getitem__):
            if order[n] > order[anchor]:  # (else hoisted already, with another reduction's cone)
                anchor.append(n)
                anchor = n


def _input_cone(x: object) -> set[Node] | None:
    """The ops computing ``x`` from program inputs only, if there are at most ``MAX_CONE``."""
    if not isinstance(x, Node) or x.op != "call_function":
        return None
    cone: set[Node] = set()
    todo = [x]
    while todo:
        n = todo.pop()
        if n in cone or n.op in ("placeholder", "get_attr"):
            continue
        if n.op != "call_function" or mutates(n) or len(cone) >= MAX_CONE:
            return None
        cone.add(n)
        todo.extend(n.all_input_nodes)
    return cone
