"""Hypothesis strategies shared by the property tests: meshes, specs and shapes."""

from __future__ import annotations

from hypothesis import strategies as st

from shardspec import Mesh, P

AXIS_NAMES = ("dp", "tp", "sp")


@st.composite
def meshes(draw: st.DrawFn, max_devices: int = 8, max_axes: int = 3) -> Mesh:
    """Simulated meshes of 1..max_devices devices with 1..max_axes axes (size-1 axes included)."""
    n_axes = draw(st.integers(1, max_axes))
    sizes: list[int] = []
    for _ in range(n_axes):
        budget = max_devices // max(1, _prod(sizes))
        sizes.append(draw(st.integers(1, max(1, min(4, budget)))))
    return Mesh(dict(zip(AXIS_NAMES, sizes)), simulate=True)


@st.composite
def specs(draw: st.DrawFn, mesh: Mesh, ndim: int) -> P:
    """A valid P for a rank-``ndim`` value on ``mesh``: each axis used at most once, tuples included."""
    free = list(mesh.axis_names)
    entries: list[object] = []
    for _ in range(ndim):
        k = draw(st.integers(0, min(2, len(free))))
        chosen = draw(st.permutations(free).map(lambda p, k=k: p[:k]))
        for name in chosen:
            free.remove(name)
        entries.append(None if k == 0 else chosen[0] if k == 1 else tuple(chosen))
    return P(*entries)


def shapes(max_ndim: int = 3, max_side: int = 9) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes with sides 0..max_side, so empty and uneven shards both occur."""
    return st.lists(st.integers(0, max_side), min_size=0, max_size=max_ndim).map(tuple)


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
