"""Plan the cheapest sequence of collectives that turns one sharding of a value into another.

Order: resolve pending sums (reduce-scatter onto a dim the target splits over exactly those axes,
or over those axes first and more after: the remaining split is then a local slice of each reduced
block, as a dim split over ``(a, b)`` is ``a``'s blocks cut by ``b``; else all-reduce), move
splits between dims (all-to-all), un-split dims the target splits differently (all-gather), then
split dims locally (a slice of this rank's block: no communication). The same plan prices
candidates during propagation and is emitted by the partitioner, so estimated and emitted
communication agree by construction. Bytes are per rank, by the ring formulas, for the largest block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from collectives import accounting
from compiler.sharding import Axes, Sharding
from shardspec.layout import chunk_bounds, max_local_shape
from shardspec.mesh import Mesh


@dataclass(frozen=True)
class Step:
    kind: str  # all_reduce | reduce_scatter | all_to_all | all_gather | slice
    axes: Axes
    dim: int = -1  # the dim acted on (all_to_all: split_dim)
    dim2: int = -1  # all_to_all: concat_dim
    size: int = -1  # all_gather / all_to_all: global length of the dim being joined
    local_shape: tuple[int, ...] = ()  # input shape on the rank with the largest block
    bytes_per_rank: float = 0.0


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _block_at(local: torch.Tensor, d: int, size: int, n: int, p: int) -> torch.Tensor:
    """``local`` with dim ``d`` as long as position ``p``'s block of ``size`` over ``n``."""
    lo, hi = chunk_bounds(size, n, p)
    return _meta((*local.shape[:d], hi - lo, *local.shape[d + 1 :]), local.dtype)


def _local(shape: tuple[int, ...], s: Sharding, mesh: Mesh) -> tuple[int, ...]:
    return max_local_shape(shape, mesh, s.spec) if s.dims else ()


def _ordered(axes: set[str] | tuple[str, ...], mesh: Mesh) -> Axes:
    return tuple(a for a in mesh.axis_names if a in axes)


def plan(shape: tuple[int, ...], dtype: torch.dtype, src: Sharding, dst: Sharding, mesh: Mesh) -> list[Step]:
    """Collectives (and local slices) taking a value from ``src`` to ``dst``. Axes of size 1 are
    dropped first: ``P(("tp", "dp"))`` with one ``tp`` device is ``P("dp")``, block for block, and
    a pending sum over one device is complete."""
    src, dst = src.on(mesh), dst.on(mesh)
    if src == dst:
        return []
    return list(_plan(tuple(shape), dtype, src, dst, mesh))


@functools.lru_cache(maxsize=1 << 16)
def _plan(
    shape: tuple[int, ...], dtype: torch.dtype, src: Sharding, dst: Sharding, mesh: Mesh
) -> tuple[Step, ...]:
    """``plan``, memoized: a pure function of immutable values, asked again for every candidate
    layout of every op (a deep model's identical layers ask the same questions)."""
    steps: list[Step] = []
    cur = src
    extra = [a for a in dst.partial if a not in cur.partial]
    assert not extra, f"cannot make a value partial over {extra}"
    pending = tuple(a for a in cur.partial if a not in dst.partial)
    if pending:
        local = _meta(_local(shape, cur, mesh), dtype)
        n = mesh.axis_size(pending)
        target = next(
            (
                d
                for d in range(len(shape))
                if not cur.dims[d]
                and dst.dims[d]
                and set(dst.dims[d]) == set(pending)
                and len(dst.dims[d]) == len(pending)
            ),
            None,
        )
        rest = tuple(a for a in cur.partial if a in dst.partial)
        if target is None:  # a dim the target splits over the pending axes first, then others:
            # reduce-scatter over the pending axes (the major blocks), then slice the rest locally
            target = next(
                (
                    d
                    for d in range(len(shape))
                    if not cur.dims[d]
                    and set(dst.dims[d][: len(pending)]) == set(pending)
                    and len(dst.dims[d]) > len(pending)
                    and shape[d] % mesh.axis_size(dst.dims[d]) == 0
                ),
                None,
            )
        if target is not None:
            axes = dst.dims[target][: len(pending)]
            steps.append(
                Step(
                    "reduce_scatter",
                    axes,
                    target,
                    local_shape=tuple(local.shape),
                    bytes_per_rank=accounting.reduce_scatter_bytes(local, target, n),
                )
            )
            dims = list(cur.dims)
            dims[target] = axes
            cur = Sharding(tuple(dims), rest)
        else:
            axes = _ordered(pending, mesh)
            steps.append(
                Step(
                    "all_reduce",
                    axes,
                    local_shape=tuple(local.shape),
                    bytes_per_rank=accounting.all_reduce_bytes(local, n),
                )
            )
            cur = replace(cur, partial=rest)
    for d in range(len(shape)):
        axes = cur.dims[d]
        if not axes or dst.dims[d] == axes:
            continue
        e = next(
            (
                e
                for e in range(len(shape))
                if e != d and not cur.dims[e] and dst.dims[e] == axes and not dst.dims[d]
            ),
            None,
        )
        if e is not None:
            local = _meta(_local(shape, cur, mesh), dtype)
            n = mesh.axis_size(axes)
            # rank p sends its own block along d (uneven: its own length) less the piece it keeps
            sent = max(
                accounting.all_to_all_bytes(_block_at(local, d, shape[d], n, p), e, n, p) for p in range(n)
            )
            steps.append(Step("all_to_all", axes, e, d, shape[d], tuple(local.shape), sent))
            dims = list(cur.dims)
            dims[e], dims[d] = axes, ()
            cur = replace(cur, dims=tuple(dims))
    for d in range(len(shape)):
        axes, want = cur.dims[d], dst.dims[d]
        if not axes or want == axes:
            continue
        if want[: len(axes)] == axes and shape[d] % mesh.axis_size(want) == 0:
            continue  # split further locally below
        local = _meta(_local(shape, cur, mesh), dtype)
        n = mesh.axis_size(axes)
        steps.append(
            Step(
                "all_gather",
                axes,
                d,
                size=shape[d],
                local_shape=tuple(local.shape),
                bytes_per_rank=accounting.all_gather_bytes(local, d, local.shape[d], n),
            )
        )
        dims = list(cur.dims)
        dims[d] = ()
        cur = replace(cur, dims=tuple(dims))
    for d in range(len(shape)):
        axes, want = cur.dims[d], dst.dims[d]
        if want != axes:
            steps.append(
                Step("slice", want[len(axes) :], d, size=shape[d], local_shape=_local(shape, cur, mesh))
            )
            dims = list(cur.dims)
            dims[d] = want
            cur = replace(cur, dims=tuple(dims))
    assert cur == dst, (src, dst, cur)
    # over axes of size 1 every collective is the identity: a 1-device mesh communicates nothing
    return tuple(s for s in steps if mesh.axis_size(s.axes) > 1)


def cost(steps: list[Step]) -> tuple[float, int]:
    """(bytes per rank, number of collectives) of a plan; local slices are free."""
    return sum(s.bytes_per_rank for s in steps), sum(1 for s in steps if s.kind != "slice")
