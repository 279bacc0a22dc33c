"""Colocate: forward values computed into the parts of a held gradient bucket not yet written.

A DP bucket held between calls (``held.py``) is resident for the whole step, but its bytes only
matter from the moment each gradient is written into its slice: a slice for the first layer's
weights is written near the end of backward, while the activations of the layers above have died
by then. DDP gets the same effect from its allocator: the ``.grad`` tensors it frees when a step
begins are where that step's activations are allocated. Here the program is known whole, so each
large enough forward value whose last read comes before a range of the bucket is written is
computed into that range (its op's ``out=`` overload: the same kernel writing the same layout),
instead of into a buffer of its own; the bucket is then allocated when the program starts.

Placement is first fit in program order: a value takes the lowest offset where every slice it
overlaps is written after its last read and no value already placed there is live at the same
time. Applies only to buckets ``pack_early`` made at once for holding (``held_buckets``): on a
per-call bucket moving the allocation to the start would raise the peak by the rest of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from compiler.passes import liveness
from compiler.passes.graph import aliases_input, make, val

aten = torch.ops.aten
HELD_BUCKET = "shardspec_held_bucket"
MIN_BYTES = 64 * 1024  # smaller values are not worth a slice: the allocator reuses them well


@dataclass(frozen=True)
class Value:
    """A candidate: its element count and the program positions of its making and last read."""

    numel: int
    made: int
    last: int


@dataclass(frozen=True)
class Region:
    """A bucket slice: elements ``[start, end)``, first written at program position ``written``."""

    start: int
    end: int
    written: int


def colocate_(gm: GraphModule) -> None:
    for buf in [n for n in gm.graph.nodes if n.meta.get(HELD_BUCKET)]:
        _colocate(gm, buf)
    gm.graph.lint()


def place(values: list[Value], regions: list[Region], size: int) -> list[int | None]:
    """Each value's offset in a ``size``-element bucket (None: not placed), first fit in order."""
    placed: list[tuple[int, int, Value]] = []
    out: list[int | None] = []
    for v in values:
        free = _merge([(r.start, r.end) for r in regions if r.written > v.last])
        busy = sorted((a, b) for a, b, p in placed if p.made <= v.last and v.made <= p.last)
        offset = _first_fit(free, busy, v.numel, size)
        out.append(offset)
        if offset is not None:
            placed.append((offset, offset + v.numel, v))
    return out


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _first_fit(free: list[tuple[int, int]], busy: list[tuple[int, int]], n: int, size: int) -> int | None:
    for a, b in free:
        at = a
        for c, d in busy:
            if d <= at or c >= b:
                continue
            if c - at >= n:
                break
            at = max(at, d)
        if at + n <= min(b, size):
            return at
    return None


def _colocate(gm: GraphModule, buf: Node) -> None:
    graph = gm.graph
    bucket = val(buf)
    if not isinstance(bucket, torch.Tensor) or bucket.dim() != 1:
        return
    like = next(
        (
            n
            for n in graph.nodes
            if n.op == "placeholder"
            and isinstance(val(n), torch.Tensor)
            and val(n).dtype == bucket.dtype
            and val(n).device == bucket.device
        ),
        None,
    )
    if like is None:
        return
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    regions = _regions(buf, pos)
    if regions is None:
        return
    root = liveness.roots(nodes, may_alias=True)  # a value's reads through anything aliasing it
    last = liveness.last_reads(nodes, root)
    escaping = liveness.result_roots(gm)
    latest = max(r.written for r in regions)
    chosen = [
        n
        for n in nodes[:latest]
        if candidate(n, root, escaping, bucket.dtype, bucket.device) and last.get(n, pos[n]) < latest
    ]
    values = [Value(val(n).numel(), pos[n], last.get(n, pos[n])) for n in chosen]
    offsets = place(values, regions, bucket.numel())
    if all(o is None for o in offsets):
        return
    holder = next(n for n in nodes if n.op != "placeholder")
    buf.args = (like, *buf.args[1:])
    holder.prepend(buf)  # allocated (taken, when held) before the first value written into it
    for n, offset in zip(chosen, offsets, strict=True):
        if offset is not None:
            into_slice(graph, n, buf, offset)


def into_slice(graph: Graph, n: Node, buf: Node, offset: int) -> None:
    """``n`` computed by its ``out=`` overload into ``buf``'s elements from ``offset`` on."""
    v = val(n)
    with graph.inserting_before(n):
        part = make(graph, aten.slice.Tensor, (buf, 0, offset, offset + v.numel()))
        dest = make(graph, aten.view.default, (part, list(v.shape)))
        into = make(graph, _out_overload(n), tuple(n.args), {**n.kwargs, "out": dest}, value=val(dest))
    into.meta = {**n.meta, "val": val(dest)}
    n.replace_all_uses_with(into)
    graph.erase_node(n)


def _regions(buf: Node, pos: dict[Node, int]) -> list[Region] | None:
    """The bucket's slices and where each is first written (None: a use this pass does not know)."""
    regions = []
    for s in buf.users:
        if s.target is not aten.slice.Tensor:
            continue
        start, end = int(s.args[2]), int(s.args[3])  # type: ignore[arg-type]
        writes = [pos[u] for u in s.users if u.target is aten.copy_.default and u.args[0] is s]
        writes += [
            pos[w]
            for u in s.users
            if u.target is aten.view.default
            for w in u.users
            if w.kwargs.get("out") is u
        ]
        if not writes:
            return None
        regions.append(Region(start, end, min(writes)))
    return regions


def candidate(
    n: Node, root: dict[Node, Node], escaping: set[Node], dtype: torch.dtype, device: torch.device
) -> bool:
    """A value of ``dtype`` on ``device`` that may be computed into a slice of another buffer."""
    v = val(n)
    return (
        n.op == "call_function"
        and root.get(n) is n
        and n not in escaping
        and not aliases_input(n)
        and isinstance(v, torch.Tensor)
        and v.dtype == dtype
        and v.device == device
        and v.is_contiguous()
        and v.numel() * v.element_size() >= MIN_BYTES
        and _out_overload(n) is not None
    )


def _out_overload(n: Node) -> torch._ops.OpOverload | None:
    """``n``'s ``out=`` overload when it takes the same arguments plus one ``out`` tensor (the
    structured kernels' form: the same computation into a given buffer), else None."""
    target = n.target
    if not isinstance(target, torch._ops.OpOverload) or "out" in n.kwargs:
        return None
    name = target.overloadpacket.__name__
    if any(word in name for word in ("rand", "dropout", "bernoulli", "normal", "empty")):
        return None
    out = getattr(target.overloadpacket, "out", None)
    if not isinstance(out, torch._ops.OpOverload) or len(target._schema.returns) != 1:
        return None
    args, out_args = target._schema.arguments, out._schema.arguments
    if [a.name for a in out_args] != [a.name for a in args] + ["out"] or len(out._schema.returns) != 1:
        return None
    return out
