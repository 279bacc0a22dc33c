"""Layout math: which global slice each device holds, for a global shape, mesh and spec.

A dim split over axes ``(a, b)`` is cut into ``size(a) * size(b)`` blocks and device ``r`` takes block
``coord_a(r) * size(b) + coord_b(r)``. Uneven lengths follow ``torch.chunk``: every block is
``ceil(L / n)`` long except the tail, so later blocks are shorter and may be empty. Everything here is
a pure function of its arguments; all later layers (collectives, partitioner, runtime) use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardspec.errors import ShardingError, fail, shown
from shardspec.mesh import Mesh
from shardspec.spec import P


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of block ``index`` when ``length`` is cut into ``parts`` torch.chunk blocks.

    Example: ``chunk_bounds(6, 4, 3) == (6, 6)`` (blocks of 2: the last one is empty)."""
    step = -(-length // parts) if length else 0
    start = min(index * step, length)
    return start, min(start + step, length)


def chunk_sizes(length: int, parts: int) -> list[int]:
    """Sizes of all ``parts`` blocks (torch.chunk layout, empty tail blocks included).

    Example: ``chunk_sizes(10, 4) == [3, 3, 3, 1]``."""
    return [stop - start for start, stop in (chunk_bounds(length, parts, i) for i in range(parts))]


def is_even(shape: Sequence[int], mesh: Mesh, spec: P) -> bool:
    """True when every split dim divides evenly over its axes.

    Example: ``is_even((8, 6), Mesh({"dp": 2, "tp": 4}, simulate=True), P("dp", "tp")) is False``."""
    return all(shape[d] % mesh.axis_size(spec.axes_of(d)) == 0 for d in range(len(spec)))


def check_spec(
    shape: Sequence[int] | None, mesh: Mesh, spec: P, *, name: str = "x", ndim: int | None = None
) -> None:
    """Validate ``spec`` against ``mesh`` and a value of ``shape`` (or of rank ``ndim``).

    ``name`` is the argument path that error messages report.
    """
    if not isinstance(spec, P):
        raise fail(
            f"{name}: expected a partition spec P(...), got {shown(spec)} of type {type(spec).__name__}.",
            f"wrap it: P({shown(spec)})"
            if isinstance(spec, str)
            else "write P('dp', None), P() for replicated, etc.",
        )
    if shape is not None:
        spec.validate(mesh, len(shape), name=name, shape=tuple(shape))
    else:
        spec.validate(mesh, ndim, name=name)


def device_slices(shape: Sequence[int], mesh: Mesh, spec: P, rank: int) -> tuple[slice, ...]:
    """The global index ranges held by device ``rank``, one slice per dim.

    Example: ``device_slices((8, 6), Mesh({"dp": 2}, simulate=True), P("dp"), 1)`` is
    ``(slice(4, 8), slice(0, 6))``."""
    out = []
    for dim, length in enumerate(shape):
        axes = spec.axes_of(dim)
        if not axes:
            out.append(slice(0, length))
            continue
        start, stop = chunk_bounds(length, mesh.axis_size(axes), mesh.axis_index(rank, axes))
        out.append(slice(start, stop))
    return tuple(out)


def local_shape(shape: Sequence[int], mesh: Mesh, spec: P, rank: int) -> tuple[int, ...]:
    """Shape of the shard held by device ``rank``.

    Example: ``local_shape((8, 6), Mesh({"dp": 2, "tp": 4}, simulate=True), P("dp", "tp"), 3)`` is
    ``(4, 0)`` (6 columns over 4 devices: blocks 2, 2, 2, 0)."""
    if not isinstance(spec, P):
        check_spec(shape, mesh, spec, name="local_shape")  # names what spec should be
    return tuple(s.stop - s.start for s in device_slices(shape, mesh, spec, rank))


def max_local_shape(shape: Sequence[int], mesh: Mesh, spec: P) -> tuple[int, ...]:
    """The largest shard shape (block 0's): what padded collectives exchange."""
    return tuple(
        -(-n // mesh.axis_size(spec.axes_of(d))) if spec.axes_of(d) else n for d, n in enumerate(shape)
    )


def shard(x: torch.Tensor, mesh: Mesh, spec: P, *, name: str = "x") -> list[torch.Tensor]:
    """Cut the global ``x`` into the pieces each device holds; element ``r`` belongs to rank ``r``.

    Example: ``shard(torch.arange(4), Mesh({"dp": 2}, simulate=True), P("dp"))`` is
    ``[tensor([0, 1]), tensor([2, 3])]``."""
    if not isinstance(x, torch.Tensor):
        raise fail(
            f"shard({name}): expected a torch.Tensor, got {type(x).__name__}.",
            "convert it first: shard(torch.as_tensor(x), mesh, spec).",
        )
    check_spec(tuple(x.shape), mesh, spec, name=name)
    # dense pieces, whatever ``x``'s strides: a step's program is compiled for dense blocks (its
    # fused kernels read rows as dense memory) and is cached by shape, not strides
    fmt = torch.contiguous_format
    return [x[device_slices(x.shape, mesh, spec, r)].clone(memory_format=fmt) for r in range(mesh.size)]


def global_shape(pieces: Sequence[torch.Tensor], mesh: Mesh, spec: P) -> tuple[int, ...]:
    """The global shape that ``pieces`` (one per rank) tile under ``spec``."""
    ndim = pieces[0].dim()
    out = []
    for dim in range(ndim):
        axes = spec.axes_of(dim)
        if not axes:
            out.append(pieces[0].shape[dim])
            continue
        group = mesh.group_of(0, axes)
        out.append(sum(pieces[r].shape[dim] for r in group))
    return tuple(out)


def unshard(
    pieces: Sequence[torch.Tensor],
    mesh: Mesh,
    spec: P,
    *,
    name: str = "x",
    check_replicas: bool = False,
) -> torch.Tensor:
    """Inverse of :func:`shard`: rebuild the global tensor from one piece per rank.

    Replicated copies are taken from the lowest rank holding them; with ``check_replicas`` every
    copy must equal it, which catches devices that drifted apart. Example::

        >>> unshard(shard(x, mesh, P("dp")), mesh, P("dp")).equal(x)
        True
    """
    if len(pieces) != mesh.size:
        raise fail(
            f"unshard({name}): got {len(pieces)} pieces for {mesh!r} with {mesh.size} devices.",
            f"pass exactly one piece per device ({mesh.size}), in rank order.",
        )
    ndims = {p.dim() for p in pieces}
    if len(ndims) != 1:
        raise fail(
            f"unshard({name}): pieces have different ranks {sorted(ndims)}.",
            "pass pieces produced for one spec; every device holds the same number of dims.",
        )
    check_spec(None, mesh, spec, name=name, ndim=pieces[0].dim())
    shape = global_shape(pieces, mesh, spec)
    out = pieces[0].new_empty(shape)
    filled: set[tuple[tuple[int, int], ...]] = set()
    for rank, piece in enumerate(pieces):
        slices = device_slices(shape, mesh, spec, rank)
        want = tuple(s.stop - s.start for s in slices)
        if tuple(piece.shape) != want:
            raise fail(
                f"unshard({name}): rank {rank} holds shape {tuple(piece.shape)}, but spec {spec} "
                f"over {mesh.describe()} gives it {want} of the global {shape}.",
                "pass the pieces in rank order, each the torch.chunk block its coordinates select.",
            )
        key = tuple((s.start, s.stop) for s in slices)
        if key in filled:
            if check_replicas and not torch.equal(out[slices], piece):
                raise ShardingError(
                    f"unshard({name}): rank {rank} disagrees with the lower rank "
                    f"holding the same block {key} under spec {spec}."
                )
            continue
        filled.add(key)
        out[slices] = piece
    return out
