"""Donation, as ``jax.jit(donate_argnums=...)``: a functional optimizer returns new parameters and
moments beside the old ones, so a step holds its model state twice at its end. When the caller
gives up the old values (``sharded(..., donate=(0, 1))``), each result is written into a donated
input buffer of the same local shape and dtype (``copy_``) as soon as both the result exists and
nothing reads that input any more, and the program returns that buffer: the new value's own buffer
dies right after, as a torch optimizer's in-place update would leave it.

Runs last, on the scheduled program; the copy is the only mutation, of inputs only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import aliases_input

aten = torch.ops.aten


def donate_(
    gm: GraphModule, donated: Sequence[int], in_paths: Sequence[str], out_paths: Sequence[str]
) -> None:
    """Write results into the donated placeholders (indices into the program's inputs)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    root: dict[Node, Node] = {}
    for n in nodes:
        src = n.all_input_nodes[0] if n.all_input_nodes else None
        alias = n.op == "call_function" and src is not None and aliases_input(n)
        root[n] = root[src] if alias and src is not None else n
    last: dict[Node, int] = {}  # the last read of each buffer, through views and pending collectives
    for n in nodes:
        done = max((pos[u] for u in n.users), default=pos[n]) if n.kwargs.get("async_op") else pos[n]
        for a in n.all_input_nodes:
            last[root[a]] = max(last.get(root[a], -1), pos[n], done)
    output = nodes[-1]
    results = list(output.args[0])
    free = [placeholders[i] for i in donated]
    for i, v in enumerate(results):
        if not isinstance(v, Node) or root[v].op == "placeholder":
            continue  # a result that is (a view of) an input keeps that buffer
        want = v.meta.get("val")
        while v.target is aten.contiguous.default:  # copy_ densifies: copy as soon as the value exists
            v = v.args[0]
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
