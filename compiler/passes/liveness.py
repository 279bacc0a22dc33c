"""Liveness: the bytes a per-rank program holds after each op, from the fake values on its nodes.

One model of memory for the whole compiler, so what ``cost()`` reports is what the passes that
trade memory for bytes (``pack_early``, ``memory_budget``) optimize: arguments are held throughout,
a computed buffer from the op that makes it to its last read, results to the end; a view or an
in-place result adds no bytes and keeps the buffer it aliases alive (a ``reshape`` that had to copy
is a buffer of its own, as its fake value's storage shows); an async collective reads its input
until its wait.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import aliases_input, val


def roots(nodes: list[Node]) -> dict[Node, Node]:
    """Each node -> the node whose buffer its value lives in."""
    root: dict[Node, Node] = {}
    for n in nodes:
        src = n.all_input_nodes[0] if n.all_input_nodes else None
        alias = n.op == "call_function" and src is not None and aliases_input(n)
        root[n] = root[src] if alias and src is not None and _shares_storage(n, src) else n
    return root


def last_reads(nodes: list[Node], root: dict[Node, Node]) -> dict[Node, int]:
    """Each buffer -> the position of its last read (an async collective's input: its wait)."""
    pos = {n: i for i, n in enumerate(nodes)}
    last: dict[Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[root[a]] = i
    for n in nodes:
        if n.op == "call_function" and n.kwargs.get("async_op") and n.users:
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

    def size(n: Node) -> int:
        if root[n] is not n or (only is not None and n not in only):
            return 0
        return nbytes(n)

    free_at: dict[int, list[Node]] = {}
    for a, i in last.items():
        if a.op != "placeholder" and a not in outputs:
            free_at.setdefault(i, []).append(a)
    live = sum(size(n) for n in nodes if n.op == "placeholder")
    out: list[tuple[Node | None, int]] = [(None, live)]
    for i, n in enumerate(nodes):
        if n.op in ("call_function", "get_attr"):
            live += size(n)
            out.append((n, live))
        live -= sum(size(a) for a in free_at.get(i, ()))
    return out


def peak(gm: GraphModule) -> int:
    return max(live for _, live in curve(gm))


def _shares_storage(n: Node, src: Node) -> bool:
    """Whether a may-alias op really returned a view: ``reshape`` of a non-contiguous input copies,
    which the fake values' storages show."""
    a, b = val(n), val(src)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return True
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)
