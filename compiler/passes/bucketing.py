"""Bucketing: many small collectives of one kind become one launch on a flat buffer, as DDP's gradient
buckets and FSDP's flat parameters do. A launch costs a latency no bandwidth hides; the bytes are the
same by the ring formulas (a sum of sizes), so only the count drops.

Collectives join a bucket when they share kind, axes, mesh, reduce op and dtype, run in the order
their inputs become ready (parameter gathers, ready from the start, in the order of first use), and
until the bucket reaches ``bucket_bytes`` (DDP's rule: a bucket closes once it holds at least that
much); ZeRO's buckets (parameter gathers, gradient reduce-scatters) close sooner (``zero_cap``),
since a bucket's tensors are all held unsharded together. A member joins only if every member's
input is ready before any member's result is used, so a bucket never waits on its own result.
Layouts that keep results exact:

- all_reduce: members flattened into one buffer, reduced in place (``all_reduce_inplace``), split.
- reduce_scatter along dim d of n even blocks: each member becomes an (n, -1) matrix whose row r is
  its block r, the rows concatenated; member r of the group then receives row r of every member.
- all_gather of even shards: shards flattened and concatenated; the result is n such rows, from
  which each member's gathered tensor is cut (one copy per member, as FSDP copies out).

Uneven shards keep their own collective.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import copy_module, lift_param_views, make, mesh_axis_size, param_views, val
from compiler.passes.regather import REGATHER

aten = torch.ops.aten
ops = torch.ops.shardspec
_KINDS = {ops.all_reduce.default: "all_reduce", ops.reduce_scatter.default: "reduce_scatter"}
_KINDS[ops.all_gather.default] = "all_gather"
ZERO_BUCKETS = 8  # parameter-gather or reduce-scatter launches per phase, by default
MIN_ZERO_BUCKET = 2**20


@dataclass
class _Bucket:
    members: list[Node] = field(default_factory=list)
    nbytes: int = 0
    ready: int = -1  # position of the last member input
    first_use: int = 1 << 62  # position of the first use of any member's result


def candidate(n: Node) -> tuple[Any, ...] | None:
    """The bucket key of a collective that may join a bucket, else None."""
    kind = _KINDS.get(n.target) if n.op == "call_function" else None  # type: ignore[call-overload]
    x = val(n.args[0]) if n.args else None
    k: dict[str, Any] = dict(n.kwargs)
    if kind is None or not isinstance(x, torch.Tensor) or k.get("async_op") or not n.users:
        return None
    groups = mesh_axis_size(k)
    if kind == "reduce_scatter" and (x.dim() == 0 or x.shape[k["dim"]] % groups):
        return None
    if kind == "all_gather" and k.get("size", -1) != x.shape[k["dim"]] * groups:
        return None  # uneven (or unknown) shards
    # a backward re-gather never shares a launch with forward gathers (it would issue in forward)
    return (kind, k["axis"], k["mesh"], k.get("op", ""), x.dtype, bool(n.meta.get(REGATHER)))


def _nbytes(n: Node) -> int:
    x = val(n.args[0])
    size: int = x.numel() * x.element_size()
    return size * mesh_axis_size(dict(n.kwargs)) if n.target is ops.all_gather.default else size


def zero_cap(total: int, bucket_bytes: int, zero_bucket_bytes: int | None) -> int:
    """The bucket size for parameter gathers and gradient reduce-scatters: one flat buffer for a
    whole phase would hold every parameter (or gradient) unsharded at once, so by default a phase is
    cut into about 8 launches (at least 1 MiB each, at most ``bucket_bytes``), close to FSDP's one
    unit in flight while the next computes."""
    if zero_bucket_bytes is not None:
        return zero_bucket_bytes
    return min(bucket_bytes, max(MIN_ZERO_BUCKET, total // ZERO_BUCKETS))


def plan(gm: GraphModule, bucket_bytes: int, zero_bucket_bytes: int | None = None) -> list[list[Node]]:
    """The buckets of two or more collectives, each in launch order."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_key: dict[tuple[Any, ...], list[Node]] = {}
    for n in nodes:
        key = candidate(n)
        if key is not None:
            by_key.setdefault(key, []).append(n)

    def ready(n: Node) -> int:
        src = n.args[0]
        assert isinstance(src, Node)
        return 0 if param_views(src) is not None or src.op == "placeholder" else pos[src]

    def first_use(n: Node) -> int:
        return min(pos[u] for u in n.users)

    buckets: list[list[Node]] = []
    for key, members in by_key.items():
        if key[0] == "all_gather":  # parameter gathers get the ZeRO cap, activation gathers DDP's
            params = [m for m in members if ready(m) == 0]
            groups = [(params, True), ([m for m in members if ready(m) != 0], False)]
        else:
            groups = [(members, key[0] == "reduce_scatter")]
        for group, zero in groups:
            order = sorted(group, key=lambda m: (ready(m), first_use(m), pos[m]))
            cap = (
                zero_cap(sum(map(_nbytes, group)), bucket_bytes, zero_bucket_bytes) if zero else bucket_bytes
            )
            buckets += _greedy(order, ready, first_use, cap)
    return [b for b in buckets if len(b) > 1]


def _greedy(
    members: list[Node], ready: Callable[[Node], int], first_use: Callable[[Node], int], bucket_bytes: int
) -> list[list[Node]]:
    """DDP's rule in launch order: a bucket closes once it holds ``bucket_bytes``; a member whose
    input is ready only after some member's result is needed starts a new one, and so does one
    whose joining would leave a bucket that had room to overlap (at least a sixteenth of the
    program between its launch and its first use) with almost none (less than a thirty-second):
    a count ready at the start and needed when backward starts is not held back to launch with
    the loss, ready only at the end of forward. Gradients ready one after another keep joining."""
    near = len(members[0].graph.nodes) // 32 if members else 0
    buckets, current = [], _Bucket()
    for n in members:
        r, f = max(current.ready, ready(n)), min(current.first_use, first_use(n))
        held = current.first_use - r < near and current.first_use - current.ready >= 2 * near
        if current.members and (r >= f or held):
            buckets.append(current.members)
            current = _Bucket()
            r, f = ready(n), first_use(n)
        current.members.append(n)
        current.nbytes += _nbytes(n)
        current.ready, current.first_use = r, f
        if current.nbytes >= bucket_bytes:
            buckets.append(current.members)
            current = _Bucket()
    return [*buckets, current.members]


def bucketing(
    gm: GraphModule, bucket_bytes: int = 25 * 2**20, zero_bucket_bytes: int | None = None
) -> GraphModule:
    """Merge consecutive independent collectives into flat-buffer launches (see the module doc)."""
    gm = copy_module(gm)
    bucketing_(gm, bucket_bytes, zero_bucket_bytes)
    gm.recompile()
    return gm


BUCKET_CAT = "shardspec_bucket_cat"  # the cat packing a bucket (pack_early fills only these)


def bucketing_(gm: GraphModule, bucket_bytes: int, zero_bucket_bytes: int | None = None) -> None:
    from compiler.passes.hoist import hoist_
    from compiler.passes.sink import sink_

    hoist_(gm)
    sink_(gm)
    for members in plan(gm, bucket_bytes, zero_bucket_bytes):
        _rewrite(gm, members)
    gm.graph.lint()


def _rewrite(gm: GraphModule, members: list[Node]) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    inputs = [m.args[0] for m in members if isinstance(m.args[0], Node)]
    start = lift_param_views(graph, inputs)  # views of parameters are ready at the start
    pos = {n: i for i, n in enumerate(graph.nodes)}
    last_input = max(inputs, key=lambda x: pos[x])
    if last_input.op == "placeholder" and start is not None:  # issue after the program's start
        last_input = start
    first_user = min((u for m in members for u in m.users), key=lambda u: pos[u])
    kwargs = dict(members[0].kwargs)
    kind = _KINDS[members[0].target]  # type: ignore[index]
    n = mesh_axis_size(kwargs)
    with graph.inserting_before(last_input.next):
        launch = _pack_and_launch(graph, kind, members, kwargs, n)
    names = [x for m in members for x in m.meta.get("shardspec_members", [m.name])]
    launch.meta["shardspec_members"] = names
    launch.meta["shardspec_reason"] = "; ".join(str(m.meta.get("shardspec_reason", "")) for m in members)
    with graph.inserting_before(first_user):
        results = _unpack(graph, kind, members, launch, n)
    for m, r in zip(members, results, strict=True):
        m.replace_all_uses_with(r)
        graph.erase_node(m)


def _to_rows(graph: Any, x: Node, dim: int, n: int) -> Node:
    """(..., d, ...) -> (n, -1): row r holds block r of ``dim`` (dim moved to the front first)."""
    rank = val(x).dim()
    if dim != 0:
        perm = [dim, *(i for i in range(rank) if i != dim)]
        x = make(graph, aten.permute.default, (x, perm))
    return make(graph, aten.reshape.default, (x, [n, -1]))


def _back(dim: int, rank: int) -> list[int]:
    """The permutation that moves dim 0 back to ``dim``."""
    return [*range(1, dim + 1), 0, *range(dim + 1, rank)]


def _pack_and_launch(graph: Any, kind: str, members: list[Node], kwargs: dict[str, Any], n: int) -> Node:
    if kind == "reduce_scatter":
        rows = [_to_rows(graph, m.args[0], m.kwargs["dim"], n) for m in members]  # type: ignore[arg-type]
        packed = make(graph, aten.cat.default, (rows, 1))
        packed.meta[BUCKET_CAT] = True
        flat = make(graph, aten.reshape.default, (packed, [-1]))
        return make(graph, ops.reduce_scatter.default, (flat,), {**kwargs, "dim": 0})
    flats = [make(graph, aten.reshape.default, (m.args[0], [-1])) for m in members]
    buf = make(graph, aten.cat.default, (flats,))
    buf.meta[BUCKET_CAT] = True
    if kind == "all_reduce":  # cat made the buffer: reduce it in place
        return make(graph, ops.all_reduce_inplace.default, (buf,), kwargs)
    length = sum(val(f).numel() for f in flats)
    return make(graph, ops.all_gather.default, (buf,), {**kwargs, "dim": 0, "size": n * length})


def _unpack(graph: Any, kind: str, members: list[Node], launch: Node, n: int) -> list[Node]:
    sizes = [val(m).numel() // (n if kind == "all_gather" else 1) for m in members]
    if kind == "all_gather":
        rows = make(graph, aten.reshape.default, (launch, [n, sum(sizes)]))
        out, start = [], 0
        for m, size in zip(members, sizes, strict=True):
            shard = val(m.args[0])
            dim = int(m.kwargs["dim"])  # type: ignore[arg-type]
            part = make(graph, aten.slice.Tensor, (rows, 1, start, start + size))
            part = make(graph, aten.reshape.default, (part, [n, *shard.shape]))
            if dim != 0:
                part = make(graph, aten.permute.default, (part, _back(dim, shard.dim() + 1)))
            out.append(make(graph, aten.reshape.default, (part, list(val(m).shape))))
            start += size
        return out
    parts = make(graph, aten.split_with_sizes.default, (launch, sizes))
    out = []
    for i, m in enumerate(members):
        part = make(graph, operator.getitem, (parts, i))
        shape = list(val(m).shape)
        dim = int(m.kwargs.get("dim", 0))  # type: ignore[arg-type]
        if kind == "reduce_scatter" and dim != 0:
            moved = [shape[dim], *(s for d, s in enumerate(shape) if d != dim)]
            part = make(graph, aten.reshape.default, (part, moved))
            out.append(make(graph, aten.permute.default, (part, _back(dim, len(shape)))))
        else:
            out.append(make(graph, aten.reshape.default, (part, shape)))
    return out
