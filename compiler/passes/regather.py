"""Re-gather: ZeRO-3's memory schedule. The partitioner gathers a parameter sharded over an axis once
and both forward and backward read that one copy, so every gathered parameter lives from its first
forward use to its last backward use: the whole model, unsharded, held across the activation peak.
Issuing a second all-gather for the backward uses lets the forward copy die after its last forward
use and the backward copy live only around the backward layer that needs it, as FSDP does
(``reshard_after_forward``). The price is the gather's bytes once more: kφΨ(2w_p + w_g) per step
instead of kφΨ(w_p + w_g).

The backward copy is placed at its first backward use; bucketing keeps forward and backward gathers
in separate buckets and overlap prefetches it one launch ahead, so it is in flight while the previous
backward layer computes, not issued at the top of backward.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import aliases_input, copy_module, mutates, param_views

ops = torch.ops.shardspec
BACKWARD = "shardspec_backward"  # node meta: the op belongs to the backward pass
REGATHER = "shardspec_regather"  # node meta: a gather issued again for backward uses
AGAIN = "@regather"  # a launch member named "<gather>@regather" is that gather issued again


def mark_backward(gm: GraphModule, backward_origins: set[str]) -> None:
    """Label each op of a per-rank program whose traced op ran in backward."""
    for n in gm.graph.nodes:
        if n.meta.get("shardspec_origin") in backward_origins:
            n.meta[BACKWARD] = True


def regather(gm: GraphModule) -> GraphModule:
    """A second all-gather of each parameter for its backward uses (see the module doc)."""
    gm = copy_module(gm)
    regather_(gm)
    gm.recompile()
    return gm


def candidates(gm: GraphModule) -> list[str]:
    """The gathers ``regather_`` would issue again, longest held first: the one whose forward
    copy would wait longest between its last forward use and its first backward use (for
    ``memory_budget``, which re-gathers only as many as the budget needs)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    held: list[tuple[int, str]] = []
    for g, backward, forward in _eligible(gm):
        first = min(order[u] for u, _ in backward)
        last = max(order[u] for u, _ in forward)
        held.append((first - last, g.name))
    return [name for _, name in sorted(held, key=lambda x: -x[0])]


Uses = list[tuple[Node, list[Node]]]  # (an op, the views from the gather to it)


def _eligible(gm: GraphModule) -> list[tuple[Node, Uses, Uses]]:
    """Each parameter gather read in forward and in backward, with its backward and forward uses."""
    out = []
    for g in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.all_gather.default]:
        src = g.args[0]
        if not isinstance(src, Node) or param_views(src) is None:
            continue  # only parameters: a computed value would have to be kept to gather it again
        uses = _compute_uses(g)
        backward = [(u, path) for u, path in uses if u.meta.get(BACKWARD)]
        forward = [(u, path) for u, path in uses if not u.meta.get(BACKWARD)]
        if backward and forward:
            out.append((g, backward, forward))
    return out


def regather_(gm: GraphModule, only: Collection[str] | None = None) -> None:
    """``only``: the names of the gathers to issue again (None: every one that is read in both)."""
    graph = gm.graph
    for g, backward, _ in _eligible(gm):
        if only is not None and g.name not in only:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((u for u, _ in backward), key=order.__getitem__)
        copies: dict[Node, Node] = {}
        with graph.inserting_before(first):
            again = graph.call_function(ops.all_gather.default, g.args, dict(g.kwargs))
            again.meta = {**g.meta, REGATHER: True, BACKWARD: True}
            again.meta["shardspec_members"] = [g.name + AGAIN]  # reports list it as its own launch
            copies[g] = again
            for _, path in backward:
                for v in path:  # the views between the gather and this use, made from the new copy
                    if v not in copies:
                        copies[v] = graph.node_copy(v, copies.__getitem__)
                        copies[v].meta = dict(v.meta)
        for u, path in backward:
            u.replace_input_with(path[-1], copies[path[-1]])
        for v in reversed(sorted({v for _, path in backward for v in path[1:]}, key=order.__getitem__)):
            if not v.users:
                graph.erase_node(v)  # a view only backward read: it now reads the new copy
    graph.lint()


def _compute_uses(g: Node) -> list[tuple[Node, list[Node]]]:
    """The ops that read ``g`` through views, each with the chain of views from ``g`` to it."""
    out: list[tuple[Node, list[Node]]] = []
    todo: list[tuple[Node, list[Node]]] = [(g, [g])]
    while todo:
        n, path = todo.pop()
        for u in n.users:
            view = u.op == "call_function" and len(u.all_input_nodes) == 1 and aliases_input(u)
            if view and not mutates(u):
                todo.append((u, [*path, u]))
            else:
                out.append((u, path))
    return out
