"""Conversion between ``P`` and DTensor placements for a mesh.

DTensor describes a sharding per *mesh* dim (``placements[i]`` says what mesh axis ``i`` does), P per
*tensor* dim. A tensor dim split over several axes maps to several ``Shard(d)`` placements; DTensor
nests those splits in mesh-dim order, so it can express a P tuple only when the tuple lists its axes in
mesh order, and, for uneven lengths, only where nested torch.chunk blocks coincide with flat ones.

``torch.distributed.tensor`` is imported on first use (it takes about 2 s to import), so importing
shardspec for a simulated mesh does not pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardspec.errors import fail
from shardspec.layout import check_spec, chunk_bounds
from shardspec.mesh import Mesh
from shardspec.spec import P

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement


def spec_to_placements(
    spec: P, mesh: Mesh, shape: Sequence[int] | None = None, *, name: str = "spec_to_placements"
) -> tuple[Placement, ...]:
    """DTensor placements (one per mesh axis) equivalent to ``spec``.

    Pass ``shape`` to also check uneven splits of a dim over several axes, where DTensor's nested
    chunking would place data differently from P's flat chunking. Example::

        >>> spec_to_placements(P("dp", None), Mesh({"dp": 2, "tp": 2}, simulate=True))
        (Shard(dim=0), Replicate())
    """
    from torch.distributed.tensor import Replicate, Shard

    check_spec(shape, mesh, spec, name=name)
    placements: list[Placement] = [Replicate() for _ in mesh.axis_names]
    order = {axis: i for i, axis in enumerate(mesh.axis_names)}
    for dim in range(len(spec)):
        axes = spec.axes_of(dim)
        if not axes:
            continue
        mesh_dims = [order[a] for a in axes]
        splitting = [order[a] for a in axes if mesh.shape[a] > 1]  # a size-1 axis splits nothing
        if splitting != sorted(splitting):
            in_order = tuple(sorted(axes, key=order.__getitem__))
            raise fail(
                f"{name}: spec {spec} splits dim {dim} over {axes} (first major), but DTensor nests "
                f"splits in mesh order {mesh.axis_names}, so it cannot express this layout.",
                f"write the axes in mesh order, {in_order!r}, or reorder the Mesh axes.",
            )
        if shape is not None and len(axes) > 1 and not _nested_matches_flat(shape[dim], mesh, axes):
            raise fail(
                f"{name}: spec {spec} splits dim {dim} of size {shape[dim]} unevenly over {axes} "
                f"(axis sizes {[mesh.shape[a] for a in axes]}); DTensor would chunk it per axis, which "
                "places the elements differently from shardspec's single torch.chunk split.",
                f"make dim {dim} a multiple of {mesh.axis_size(axes)}, or split it over one axis.",
            )
        for mesh_dim in mesh_dims:
            placements[mesh_dim] = Shard(dim)
    return tuple(placements)


def placements_to_spec(
    placements: Sequence[Placement], mesh: Mesh, ndim: int, *, name: str = "placements_to_spec"
) -> P:
    """The ``P`` equivalent to DTensor ``placements`` on ``mesh`` for a tensor of rank ``ndim``.

    Example::

        >>> placements_to_spec((Shard(0), Replicate()), Mesh({"dp": 2, "tp": 2}, simulate=True), 2)
        P('dp')
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import Placement

    if isinstance(placements, Placement):
        raise fail(
            f"{name}: placements is one {placements!r}, not a sequence with one per mesh axis.",
            f"pass a tuple, e.g. ({placements!r},) for a one-axis mesh; {mesh.describe()} needs "
            f"{len(mesh.axis_names)}.",
        )
    if len(placements) != len(mesh.axis_names):
        raise fail(
            f"{name}: {len(placements)} placements {tuple(placements)} for {mesh.describe()}, which "
            f"has {len(mesh.axis_names)} axes.",
            "give one placement per mesh axis, in mesh order.",
        )
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for axis, placement in zip(mesh.axis_names, placements):
        if type(placement) is Shard:
            if not -ndim <= placement.dim < ndim:
                raise fail(
                    f"{name}: placement {placement} on mesh axis {axis!r} shards dim "
                    f"{placement.dim} of a {ndim}-dim tensor.",
                    f"shard a dim in 0..{ndim - 1}.",
                )
            entries[placement.dim % ndim].append(axis)
        elif not placement.is_replicate():
            raise fail(
                f"{name}: placement {placement} on mesh axis {axis!r} has no P equivalent (P "
                "describes plain Shard and Replicate only; Partial is a pending reduction and "
                "strided shards a nested layout).",
                "redistribute the DTensor to Shard/Replicate placements first (e.g. "
                "x.redistribute(placements=[Replicate()]*mesh.ndim)).",
            )
    return P(*(tuple(e) if e else None for e in entries))


def _nested_matches_flat(length: int, mesh: Mesh, axes: tuple[str, ...]) -> bool:
    """Do DTensor's per-axis nested chunks equal one flat chunk over the product, for all blocks?"""
    sizes = [mesh.shape[a] for a in axes]
    total = mesh.axis_size(axes)
    for flat_index in range(total):
        start, stop, rest = 0, length, flat_index
        digits = []
        for size in reversed(sizes):
            digits.append(rest % size)
            rest //= size
        for size, digit in zip(sizes, reversed(digits)):
            lo, hi = chunk_bounds(stop - start, size, digit)
            start, stop = start + lo, start + hi
        flat = chunk_bounds(length, total, flat_index)
        if (stop > start or flat[1] > flat[0]) and (start, stop) != flat:
            return False
    return True
