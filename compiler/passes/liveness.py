"""Liveness: the bytes a per-rank program holds after each op, from the fake values on its nodes.

One model of memory for the whole compiler, so what ``cost()`` reports is what the passes that
trade memory for bytes (``pack_early``, ``memory_budget``) optimize: arguments are held throughout,
a computed buffer from the op that makes it to its last read (one nothing reads: right after it),
results to the end; a multi-output op makes all its results at once, each freed on its own after
the op's last ``getitem`` (the same storage, not a second buffer); a view or an in-place result adds
no bytes and keeps the buffer it aliases alive (a ``reshape`` that had to copy is a buffer of its
own, as its fake value's storage shows); an async all-gather or reduce-scatter
reads its input until its wait (c10d's work holds it: gloo reduce-scatters a copy of the same size;
a simulated mesh keeps it referenced as well), while an async all-reduce copies its input into its
output at launch (``all_reduce_inplace`` reduces the buffer itself, live while the result is).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import alias_source, aliases_input, val

_READ_UNTIL_WAIT = {torch.ops.shardspec.all_gather.default, torch.ops.shardspec.reduce_scatter.default}


def roots(nodes: list[Node], may_alias: bool = False) -> dict[Node, Node]:
    """Each node -> the node whose buffer its value lives in (a repeated ``getitem`` of one result
    of a multi-output op: the first). By default an op that may return a view is one where the fake
    values share storage (a ``reshape`` that copied is a buffer of its own), which is what memory
    counts; ``may_alias``: wherever its schema allows (a custom op's fake may give a fresh storage
    for what really is its input, as ``all_reduce_inplace``'s does), what reusing a buffer needs."""
    root: dict[Node, Node] = {}
    first: dict[tuple[Node, object], Node] = {}
    for n in nodes:
        src = alias_source(n)
        alias = n.op == "call_function" and src is not None and aliases_input(n)
        shared = alias and src is not None and (may_alias or _shares_storage(n, src))
        root[n] = root[src] if shared and src is not None else n
        if n.target is operator.getitem and root[n] is n and src is not None:
            root[n] = first.setdefault((src, n.args[1]), n)
    return root


def parts(nodes: list[Node], root: dict[Node, Node]) -> dict[Node, Node]:
    """Each fresh result of a multi-output op (its ``getitem``) -> the op. The op allocates all its
    results; the tuple holds each until its last ``getitem``, the result's own readers after that."""
    return {
        n: n.args[0]
        for n in nodes
        if n.target is operator.getitem
        and root[n] is n
        and isinstance(n.args[0], Node)
        and root[n.args[0]] is n.args[0]
        and isinstance(n.args[0].meta.get("val"), (tuple, list))
    }


def last_reads(nodes: list[Node], root: dict[Node, Node]) -> dict[Node, int]:
    """Each buffer -> the position of its last read (an async gather's or scatter's input: its wait)."""
    pos = {n: i for i, n in enumerate(nodes)}
    last: dict[Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[root[a]] = i
    for n in nodes:
        if n.target in _READ_UNTIL_WAIT and n.kwargs.get("async_op") and n.users:
            done = max(pos[u] for u in n.users)
            for a in n.all_input_nodes:
                last[root[a]] = max(last[root[a]], done)
    return last


def nbytes(n: Node) -> int:
    v = val(n)
    vals = v if isinstance(v, (tuple, list)) else [v]
    return sum(int(t.numel() * t.element_size()) for t in vals if isinstance(t, torch.Tensor))


def curve(gm: GraphModule, only: set[Node] | None = None) -> list[tuple[Node | None, int]]:
    """Live bytes after each op (``None``: before the first), the op's result and inputs counted
    together; ``only``: count just these buffers. Needs ``meta["val"]`` on every node."""
    nodes = list(gm.graph.nodes)
    root = roots(nodes)
    last = last_reads(nodes, root)
    outputs = {root[a] for a in nodes[-1].all_input_nodes}
    part_of = parts(nodes, root)
    pos = {n: i for i, n in enumerate(nodes)}

    def counted(n: Node) -> bool:
        return root[n] is n and (only is None or n in only)

    freed = {n: nbytes(n) if counted(n) else 0 for n in nodes}  # bytes a buffer frees
    made = {n: 0 if n in part_of else b for n, b in freed.items()}  # bytes it adds
    for g, op in part_of.items():  # a multi-output op's results: allocated by the op, not again
        made[op] += freed[g] - (nbytes(g) if counted(op) else 0)
        freed[op] -= nbytes(g) if counted(op) else 0
        last[g] = max(last.get(g, pos[g]), last.get(op, pos[op]))
    free_at: dict[int, list[Node]] = {}
    for n in nodes:  # a computed buffer nothing reads dies right after the op that made it
        if (
            root[n] is n
            and n not in outputs
            and (n.op == "call_function" or (n.op == "get_attr" and n in last))
        ):
            free_at.setdefault(last.get(n, pos[n]), []).append(n)
    live = sum(freed[n] for n in nodes if n.op == "placeholder")
    out: list[tuple[Node | None, int]] = [(None, live)]
    for i, n in enumerate(nodes):
        if n.op in ("call_function", "get_attr"):
            live += made[n]
            out.append((n, live))
        live -= sum(freed[a] for a in free_at.get(i, ()))
    return out


def peak(gm: GraphModule) -> int:
    return max(live for _, live in curve(gm))


def result_roots(gm: GraphModule, copied: set[Node] | frozenset[Node] = frozenset()) -> set[Node]:
    """The nodes whose storage the program's results may share (through views and ops returning
    an input, such as ``all_reduce_inplace``); ``copied``: results that will be returned as copies."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    seen: set[Node] = set()
    todo = [n for n in out.all_input_nodes if n not in copied]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and aliases_input(n):
            todo.extend(n.all_input_nodes)  # any input, not only the first: err on holding less
    return seen


def _shares_storage(n: Node, src: Node) -> bool:
    """Whether a may-alias op really returned a view: ``reshape`` of a non-contiguous input copies,
    which the fake values' storages show."""
    a, b = val(n), val(src)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return True
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)
