"""``shardspec.AUTO``: a spec that asks the global planner to choose that input's or result's layout.

An AUTO leaf (or a whole subtree given one AUTO) takes, as its candidates, every even layout of its
shape on the mesh: each mesh axis splits one dim or none (several axes on one dim in mesh order).
The planner picks one per leaf together with every op's sharding, under the machine's memory limit
(the bytes each device holds of the step's inputs), and ``explain()`` names the choice with its
modeled time and memory against the next best layout of that leaf.
"""

from __future__ import annotations

import itertools
import math

from compiler.sharding import Sharding
from shardspec.mesh import Mesh


class _Auto:
    """The AUTO spec (one instance)."""

    def __repr__(self) -> str:
        return "AUTO"

    def __reduce__(self) -> str:
        return "AUTO"


AUTO = _Auto()


def layouts(
    shape: tuple[int, ...], mesh: Mesh, cap: int = 32, exclude: frozenset[str] = frozenset()
) -> list[Sharding]:
    """Even layouts of ``shape`` on ``mesh``, fewest devices holding each element first; no layout
    splits over an ``exclude`` axis (a pipeline's: each of its positions computes other values)."""
    axes = [a for a in mesh.axis_names if mesh.axis_size(a) > 1 and a not in exclude]
    out: set[Sharding] = set()
    for dims in itertools.product(range(len(shape) + 1), repeat=len(axes)):
        per: list[tuple[str, ...]] = [() for _ in shape]
        for a, d in zip(axes, dims, strict=True):
            if d < len(shape):
                per[d] = (*per[d], a)
        if all(n % mesh.axis_size(p) == 0 for n, p in zip(shape, per, strict=True) if p):
            out.add(Sharding(tuple(per)))
    ranked = sorted(out, key=lambda s: (-mesh.axis_size(s.axes), str(s)))
    return ranked[:cap]


def held_bytes(shape: tuple[int, ...], itemsize: int, s: Sharding, mesh: Mesh) -> int:
    """Bytes the device with the largest block holds of a value laid out as ``s`` (5 rows over 3
    devices: 2 rows; a size-1 dim split over 2: 1)."""
    return itemsize * math.prod(
        -(-n // mesh.axis_size(p)) if p else n for n, p in zip(shape, s.dims, strict=True)
    )
