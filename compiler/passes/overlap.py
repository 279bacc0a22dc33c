"""Overlap: each collective is issued asynchronously as soon as its input is ready and waited for at
the first use of its result, so a gradient's reduction runs while the rest of backward computes
instead of after it. Parameter gathers (inputs ready from the start) are issued one launch ahead of
their use rather than all at once: gather k+1 is in flight while gather k's layer computes, without
holding every gathered parameter from the first op on.

The order is a function of the program alone, and every rank runs the same program structure, so
every rank issues the same collectives in the same order (SPMD); the simulated backend completes
each collective at its rendezvous, so there the schedule changes only the order.
"""

from __future__ import annotations

import itertools

import torch
from torch.fx import Graph, GraphModule, Node

from compiler.passes.graph import copy_module, lift_param_views, make, param_views

aten = torch.ops.aten
ops = torch.ops.shardspec
ASYNC = {
    ops.all_gather.default,
    ops.reduce_scatter.default,
    ops.all_reduce.default,
    ops.all_reduce_inplace.default,
}
# ops that only repack a collective's input (bucketing's flatten and concatenate): they move with it
_PACK = {aten.reshape.default, aten.permute.default, aten.cat.default}


def overlap(gm: GraphModule) -> GraphModule:
    """Async issue at readiness (parameter gathers one ahead), wait before the first use."""
    gm = copy_module(gm)
    overlap_(gm)
    gm.recompile()
    return gm


def overlap_(gm: GraphModule) -> None:
    graph = gm.graph
    launches = [n for n in graph.nodes if n.op == "call_function" and n.target in ASYNC and n.users]
    prefetch = []
    for c in launches:
        chain = _pack_chain(c)
        inputs = _external_inputs(chain)
        if all(x.op == "placeholder" or param_views(x) is not None for x in inputs):
            lift_param_views(graph, inputs)
            prefetch.append(chain)
        else:
            _hoist(graph, chain)
    _schedule_prefetch(graph, prefetch)
    for c in launches:
        _wait_late(graph, c)
    _bound_scatters(graph, [c for c in launches if c.target is ops.reduce_scatter.default])
    graph.lint()


def _bound_scatters(graph: Graph, scatters: list[Node]) -> None:
    """One reduce-scatter in flight: each is waited for before the next one is packed. Its input
    (the full gradients) must live until the wait; waiting there instead of at the optimizer lets
    them die while backward still runs, as FSDP frees a gradient once its reduce-scatter is done."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    scatters = sorted(scatters, key=order.__getitem__)
    for c, following in itertools.pairwise(scatters):
        order = {n: i for i, n in enumerate(graph.nodes)}
        (wait,) = c.users
        start = _pack_chain(following)[0]
        if order[start] < order[wait] and order[c] < order[start]:
            start.prepend(wait)


def _pack_chain(c: Node) -> list[Node]:
    """``c`` and the repacking ops that exist only to feed it, in program order."""
    chain, todo = [c], [c]
    while todo:
        for x in todo.pop().all_input_nodes:
            if x.op == "call_function" and x.target in _PACK and set(x.users) <= set(chain):
                chain.append(x)
                todo.append(x)
    order = {n: i for i, n in enumerate(c.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def _external_inputs(chain: list[Node]) -> list[Node]:
    inside = set(chain)
    return [x for n in chain for x in n.all_input_nodes if x not in inside]


def _hoist(graph: Graph, chain: list[Node]) -> None:
    """Move the chain right after the last of its inputs (placeholders count as the program start)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = _external_inputs(chain)
    anchor = max(inputs, key=order.__getitem__) if inputs else None
    if anchor is None or anchor.op == "placeholder":
        anchor = max((n for n in graph.nodes if n.op == "placeholder"), key=order.__getitem__, default=None)
    if anchor is None or order[anchor] > order[chain[0]]:
        return
    for n in chain:
        anchor.append(n)
        anchor = n


def _schedule_prefetch(graph: Graph, chains: list[list[Node]]) -> None:
    """Gathers of parameters: the first at the program start, each next one where the previous one's
    result is first used."""
    order = {n: i for i, n in enumerate(graph.nodes)}

    def first_use(chain: list[Node]) -> int:
        return min(order[u] for u in chain[-1].users)

    chains = sorted(chains, key=first_use)
    for i, chain in enumerate(chains):
        if i == 0:
            _hoist(graph, chain)
            continue
        order = {n: j for j, n in enumerate(graph.nodes)}
        previous = chains[i - 1][-1]
        before = min(previous.users, key=order.__getitem__)
        mine = min(chain[-1].users, key=order.__getitem__)
        if order[mine] < order[before]:
            before = mine
        for n in chain:
            before.prepend(n)


def _wait_late(graph: Graph, c: Node) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(c.users, key=order.__getitem__)
    c.kwargs = {**c.kwargs, "async_op": True}
    with graph.inserting_before(first):
        w = make(graph, ops.wait.default, (c,))
    c.replace_all_uses_with(w, delete_user_cb=lambda u: u is not w)
