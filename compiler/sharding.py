"""``Sharding``: how one value is laid out: the mesh axes splitting each dim, plus pending sums.

``partial`` names axes over which the value is a pending sum (every device holds an addend): the state
that matmul over a split contraction dim produces, and that a later reduce-scatter or all-reduce
resolves. Immutable so it can key memo tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspec.mesh import Mesh
from shardspec.spec import P

Axes = tuple[str, ...]


@dataclass(frozen=True)
class Sharding:
    dims: tuple[Axes, ...]
    partial: Axes = ()

    @staticmethod
    def replicated(ndim: int) -> Sharding:
        return Sharding(((),) * ndim)

    @staticmethod
    def of(spec: P, ndim: int, mesh: Mesh | None = None) -> Sharding:
        """``spec``'s layout; with ``mesh``, without its axes of size 1, which split nothing
        (``P(("tp", "dp"))`` with one ``tp`` device holds ``P("dp")``'s blocks)."""
        dims = tuple(spec.axes_of(d) for d in range(ndim))
        if mesh is not None:
            dims = tuple(tuple(a for a in d if mesh.axis_size(a) > 1) for d in dims)
        return Sharding(dims)

    def on(self, mesh: Mesh) -> Sharding:
        """This layout without the mesh's axes of size 1 (a pending sum over one device is
        complete)."""
        if all(mesh.axis_size(a) > 1 for a in self.axes + self.partial):
            return self
        dims = tuple(tuple(a for a in d if mesh.axis_size(a) > 1) for d in self.dims)
        return Sharding(dims, tuple(a for a in self.partial if mesh.axis_size(a) > 1))

    @property
    def spec(self) -> P:
        return P(*(a if a else None for a in self.dims))

    @property
    def axes(self) -> Axes:
        return tuple(a for d in self.dims for a in d)

    def without_partial(self) -> Sharding:
        return Sharding(self.dims)

    def __str__(self) -> str:
        text = repr(self.spec)
        return text + (f" + Partial({', '.join(self.partial)})" if self.partial else "")
