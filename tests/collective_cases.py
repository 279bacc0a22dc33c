"""Collective test cases shared by the simulated and gloo tests.

Each case builds every rank's input from one global tensor (or per-rank tensors for reductions) and
its expected per-rank output from the full tensor, independently of the collective kernels. Values
are small integers so every reduction order gives the same bits, which lets simulated and gloo
results be compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import collectives as C
from shardspec import Mesh, P, device_slices, shard

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64)


@dataclass(frozen=True)
class Case:
    kind: str
    axes: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int = 0
    dim2: int = 1
    op: str = "sum"
    pass_size: bool = True

    @property
    def name(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (
            f"{self.kind}-{'x'.join(self.axes)}-{dt}-{self.shape}-d{self.dim}-{self.dim2}-{self.op}"
            f"{'' if self.pass_size else '-nosize'}"
        )


def axis_choices(mesh: Mesh) -> list[tuple[str, ...]]:
    names = mesh.axis_names
    out = [(a,) for a in names]
    if len(names) >= 2:
        out += [tuple(names), tuple(reversed(names))]
    return out


def cases(mesh: Mesh, dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[Case]:
    out: list[Case] = []
    for axes in axis_choices(mesh):
        for dtype in dtypes:
            for shape in ((4, 8), (5, 7)):  # even, and uneven with an empty block on 4 devices
                for dim in (0, 1):
                    out.append(Case("all_gather", axes, dtype, shape, dim, pass_size=dim == 0))
                    out.append(Case("reduce_scatter", axes, dtype, shape, dim))
                    out.append(Case("all_to_all", axes, dtype, shape, dim, 1 - dim, pass_size=dim == 1))
                out.append(Case("all_to_all", axes, dtype, shape, 1, 1))
            out.append(Case("all_reduce", axes, dtype, (3, 5)))
            out.append(Case("ppermute", axes, dtype, (2, 3)))
            out.append(Case("broadcast", axes, dtype, (2, 3)))
        for op in ("avg", "max", "min"):
            out.append(Case("all_reduce", axes, torch.float32, (3, 5), op=op))
            out.append(Case("reduce_scatter", axes, torch.float32, (5, 7), 1, op=op))
            out.append(Case("reduce_scatter", axes, torch.float32, (4, 8), 0, op=op))  # even blocks
    return out


def _global(case: Case) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(case.name) % 2**31)
    return torch.randint(-8, 9, case.shape, generator=g).to(case.dtype)


def _spec_on(dim: int, axes: tuple[str, ...], ndim: int) -> P:
    entries: list[Any] = [None] * ndim
    entries[dim] = axes
    return P(*entries)


def _per_rank(case: Case, mesh: Mesh) -> list[torch.Tensor]:
    base = _global(case)
    return [
        (base + rank * 3).to(case.dtype) if case.dtype != torch.int64 else base + rank * 3
        for rank in range(mesh.size)
    ]


def inputs(case: Case, mesh: Mesh) -> list[torch.Tensor]:
    """Every rank's input, by rank."""
    if case.kind == "all_gather":
        return shard(_global(case), mesh, _spec_on(case.dim, case.axes, 2))
    if case.kind == "all_to_all":
        return shard(_global(case), mesh, _spec_on(case.dim2, case.axes, 2))
    return _per_rank(case, mesh)


def _reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    s = torch.stack(xs)
    if op == "sum":
        return s.sum(0).to(xs[0].dtype)
    if op == "avg":
        return s.sum(0) / len(xs)
    return s.amax(0) if op == "max" else s.amin(0)


def perm_for(n: int) -> list[tuple[int, int]]:
    """A shift by one along the axis, minus the wrap-around pair (so position 0 receives zeros)."""
    return [(i, i + 1) for i in range(n - 1)] if n > 2 else [(i, (i + 1) % n) for i in range(n)]


def expected(case: Case, mesh: Mesh) -> list[torch.Tensor]:
    """Every rank's expected output, from the full tensor."""
    xs = inputs(case, mesh)
    if case.kind == "all_gather":
        g = _global(case)
        return [g.clone() for _ in range(mesh.size)]
    if case.kind == "all_to_all":
        g = _global(case)
        return (
            shard(g, mesh, _spec_on(case.dim, case.axes, 2))
            if case.dim != case.dim2
            else _a2a_same_dim(xs, case, mesh)
        )
    out = []
    for rank in range(mesh.size):
        group = mesh.group_of(rank, case.axes)
        pos, n = group.index(rank), len(group)
        if case.kind == "all_reduce":
            out.append(_reduce([xs[r] for r in group], case.op))
        elif case.kind == "reduce_scatter":
            total = _reduce([xs[r] for r in group], case.op)
            out.append(total[device_slices_1d(total, case.dim, n, pos)])
        elif case.kind == "ppermute":
            src = [s for s, d in perm_for(n) if d == pos]
            out.append(xs[group[src[0]]].clone() if src else torch.zeros_like(xs[rank]))
        elif case.kind == "broadcast":
            out.append(xs[group[n - 1]].clone())
    return out


def device_slices_1d(t: torch.Tensor, dim: int, n: int, pos: int) -> tuple[slice, ...]:
    one = Mesh({"g": n}, simulate=True)
    return device_slices(tuple(t.shape), one, _spec_on(dim, ("g",), t.dim()), pos)


def _a2a_same_dim(xs: list[torch.Tensor], case: Case, mesh: Mesh) -> list[torch.Tensor]:
    out = []
    for rank in range(mesh.size):
        group = mesh.group_of(rank, case.axes)
        pos, n = group.index(rank), len(group)
        blocks = [xs[r][device_slices_1d(xs[r], case.dim, n, pos)] for r in group]
        out.append(torch.cat(blocks, case.dim))
    return out


def call(case: Case, mesh: Mesh, x: Any) -> Any:
    """Run the case's collective on ``x`` (one rank's tensor, or a list in list mode)."""
    n = mesh.axis_size(case.axes)
    if case.kind == "all_gather":
        return C.all_gather(
            x, dim=case.dim, axis=case.axes, mesh=mesh, size=case.shape[case.dim] if case.pass_size else None
        )
    if case.kind == "reduce_scatter":
        return C.reduce_scatter(x, dim=case.dim, axis=case.axes, mesh=mesh, op=case.op)
    if case.kind == "all_reduce":
        return C.all_reduce(x, axis=case.axes, mesh=mesh, op=case.op)
    if case.kind == "all_to_all":
        size = case.shape[case.dim2] if case.pass_size and case.dim != case.dim2 else None
        return C.all_to_all(x, split_dim=case.dim, concat_dim=case.dim2, axis=case.axes, mesh=mesh, size=size)
    if case.kind == "ppermute":
        return C.ppermute(x, axis=case.axes, perm=perm_for(n), mesh=mesh)
    return C.broadcast(x, axis=case.axes, src=n - 1, mesh=mesh)
