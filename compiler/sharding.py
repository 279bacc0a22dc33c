"""``Sharding``: how one value is laid out: the mesh axes splitting each dim, plus pending sums.

``partial`` names axes over which the value is a pending sum (every device holds an addend): the state
that matmul over a split contraction dim produces, and that a later reduce-scatter or all-reduce
resolves. Immutable so it can key memo tables.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    def of(spec: P, ndim: int) -> Sharding:
        return Sharding(tuple(spec.axes_of(d) for d in range(ndim)))

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
