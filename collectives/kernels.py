"""Exact collective semantics over one group: every member's local tensor in, every member's result out.

Lists are in group position order (``Mesh.axis_index``). The simulated backend runs these directly; the
distributed backend must produce the same values, and the tests check both against references computed
from the full tensor. Uneven shards follow the torch.chunk layout of ``shardspec.layout``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from shardspec.errors import ShardingError, fail
from shardspec.layout import chunk_bounds, chunk_sizes

REDUCE_OPS = ("sum", "avg", "max", "min")


def reduce(xs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Combine equal-shape tensors in position order (sum, avg = sum / n, max, min)."""
    if op in ("sum", "avg"):
        out = functools.reduce(torch.add, xs[1:], xs[0].clone())
        return out / len(xs) if op == "avg" else out
    fn = torch.maximum if op == "max" else torch.minimum
    return functools.reduce(fn, xs[1:], xs[0].clone())


def narrow_chunk(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    start, stop = chunk_bounds(x.shape[dim], parts, index)
    return x.narrow(dim, start, stop - start)


def same_shapes(kind: str, xs: Sequence[torch.Tensor], skip_dim: int | None = None) -> None:
    """SPMD collectives need one shape on every rank (except along ``skip_dim``)."""

    def key(t: torch.Tensor) -> tuple[int, ...]:
        return tuple(n for d, n in enumerate(t.shape) if d != skip_dim)

    if len({key(t) for t in xs}) > 1 or len({t.dtype for t in xs}) > 1:
        shapes = [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in xs]
        where = f" outside dim {skip_dim}" if skip_dim is not None else ""
        raise fail(
            f"{kind}: group members hold different shapes/dtypes{where}: {shapes}.",
            "every rank must pass a tensor of the same shape and dtype (uneven shards "
            "may differ only along the sharded dim).",
        )


def all_gather(xs: Sequence[torch.Tensor], dim: int, size: int | None) -> list[torch.Tensor]:
    same_shapes("all_gather", xs, skip_dim=dim)
    lengths = [t.shape[dim] for t in xs]
    if size is not None and lengths != chunk_sizes(size, len(xs)):
        raise fail(
            f"all_gather: shards along dim {dim} have lengths {lengths}, but a global size "
            f"of {size} over {len(xs)} devices gives torch.chunk blocks "
            f"{chunk_sizes(size, len(xs))}.",
            "pass size= the global length along dim (or omit it to gather whatever each rank holds).",
        )
    out = torch.cat(list(xs), dim)
    return [out.clone() for _ in xs]


def reduce_scatter(xs: Sequence[torch.Tensor], dim: int, op: str) -> list[torch.Tensor]:
    same_shapes("reduce_scatter", xs)
    total = reduce(xs, op)
    n = len(xs)
    return [narrow_chunk(total, dim, n, i).clone() for i in range(n)]


def all_reduce(xs: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
    same_shapes("all_reduce", xs)
    total = reduce(xs, op)
    return [total.clone() for _ in xs]


def all_to_all(
    xs: Sequence[torch.Tensor], split_dim: int, concat_dim: int, size: int | None = None
) -> list[torch.Tensor]:
    same_shapes("all_to_all", xs, skip_dim=concat_dim)
    n = len(xs)
    lengths = [int(x.shape[concat_dim]) for x in xs]
    if size is not None and size >= 0 and lengths != chunk_sizes(size, n):  # (as a real run checks)
        raise fail(
            f"all_to_all: shards along concat_dim {concat_dim} have lengths {lengths}, but a global "
            f"size of {size} over {n} devices gives torch.chunk blocks {chunk_sizes(size, n)}.",
            "pass size= the global length along concat_dim (or omit it).",
        )
    return [torch.cat([narrow_chunk(x, split_dim, n, j) for x in xs], concat_dim).clone() for j in range(n)]


def ppermute(xs: Sequence[torch.Tensor], perm: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    same_shapes("ppermute", xs)
    out = [torch.zeros_like(x) for x in xs]
    for src, dst in perm:
        out[dst] = xs[src].clone()
    return out


def broadcast(xs: Sequence[torch.Tensor], src: int) -> list[torch.Tensor]:
    same_shapes("broadcast", xs)
    return [xs[src].clone() for _ in xs]


def check_perm(perm: Sequence[tuple[int, int]], n: int, axes: tuple[str, ...]) -> list[tuple[int, int]]:
    """Validate a ppermute permutation: pairs of positions in range, each source and target once."""
    pairs: list[tuple[int, int]] = []
    for item in perm:
        if not (
            isinstance(item, (tuple, list))
            and len(item) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        ):
            raise fail(
                f"ppermute over {axes}: perm item {item!r} is not a (src, dst) pair of ints.",
                "pass perm=[(0, 1), (1, 2), ...] with positions along the axis.",
            )
        src, dst = int(item[0]), int(item[1])
        if not (0 <= src < n and 0 <= dst < n):
            raise fail(
                f"ppermute over {axes}: pair ({src}, {dst}) is outside the group of size {n}.",
                f"use positions 0..{n - 1} along the axis.",
            )
        pairs.append((src, dst))
    for what, idx in (("source", 0), ("destination", 1)):
        seen = [p[idx] for p in pairs]
        dup = sorted({v for v in seen if seen.count(v) > 1})
        if dup:
            raise fail(
                f"ppermute over {axes}: {what} position(s) {dup} appear more than once in perm={pairs}.",
                "each position may send once and receive once.",
            )
    return pairs


def check_group_error(kind: str, calls: Sequence[object]) -> ShardingError:
    return ShardingError(
        f"SPMD violation in {kind}: the members of one group made different collective calls "
        f"{list(calls)}. Every rank must run the same sequence of collectives with the same "
        "arguments; rank-dependent control flow around collectives is the usual cause."
    )
