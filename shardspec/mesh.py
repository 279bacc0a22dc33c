"""``Mesh``: named device axes laid out major -> minor over ranks.

Rank ``r`` sits at the row-major coordinates of ``r`` in the axis sizes, the same layout as
``torch.distributed.DeviceMesh``, so a simulated mesh and a real one agree on who holds what.
"""

from __future__ import annotations

import atexit
import math
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from shardspec.errors import fail, shown

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _parse_axes(axes: object) -> tuple[tuple[str, int], ...]:
    if isinstance(axes, Mapping):
        pairs: list[Any] = list(axes.items())
    elif isinstance(axes, Iterable) and not isinstance(axes, (str, bytes)):
        pairs = list(axes)
    else:
        raise fail(
            f"Mesh(axes={shown(axes)}): axes must be a dict of name -> size or a sequence of "
            f"(name, size) pairs, got {type(axes).__name__}.",
            "write Mesh({'dp': 2, 'tp': 4}) or Mesh([('dp', 2), ('tp', 4)]).",
        )
    if not pairs:
        raise fail(
            "Mesh(axes={}): a mesh needs at least one axis.",
            "for a single device write Mesh({'dp': 1}).",
        )
    parsed: list[tuple[str, int]] = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise fail(
                f"Mesh(axes={shown(axes)}): item {i} is {shown(pair)}, not a (name, size) pair.",
                "write Mesh({'dp': 2, 'tp': 4}) or Mesh([('dp', 2), ('tp', 4)]).",
            )
        name, size = pair
        if not isinstance(name, str) or not name.isidentifier():
            raise fail(
                f"Mesh(axes={shown(axes)}): axis name {name!r} is not a valid name.",
                "name axes with identifiers such as 'dp', 'tp', 'pp'.",
            )
        if isinstance(size, bool) or not isinstance(size, int):
            raise fail(
                f"Mesh(axes={shown(axes)}): axis {name!r} has size {shown(size)} of type "
                f"{type(size).__name__}; sizes are device counts.",
                f"give {name!r} a positive int size, e.g. {{{name!r}: 2}}.",
            )
        if size <= 0:
            raise fail(
                f"Mesh(axes={shown(axes)}): axis {name!r} has size {size}; every axis needs at least one "
                "device.",
                f"give {name!r} a size >= 1 (size 1 means the axis is present but not split).",
            )
        if any(name == seen for seen, _ in parsed):
            raise fail(
                f"Mesh(axes={shown(axes)}): axis name {name!r} appears twice.",
                "give each mesh axis a distinct name.",
            )
        parsed.append((name, size))
    return tuple(parsed)


class Mesh:
    """A named device mesh: axes major -> minor, rank = row-major index of its coordinates (as
    ``torch.distributed.DeviceMesh``).

    ``Mesh(axes)`` is real: this process is one device of a ``torch.distributed`` world (initialized
    from the torchrun environment if needed; the world size must be the product of the axis
    sizes). ``Mesh(axes, simulate=True)`` makes that many virtual devices in this process, which run
    the same per-device programs and collectives. Example::

        >>> mesh = Mesh({"dp": 2, "tp": 4}, simulate=True)
        >>> mesh.size, mesh.shape["tp"], mesh.axis_names
        (8, 4, ('dp', 'tp'))
        >>> print(mesh)  # the rank grid
    """

    __slots__ = ("_axes", "_device_mesh", "_rank", "_simulate")
    _axes: tuple[tuple[str, int], ...]
    _simulate: bool
    _device_mesh: DeviceMesh | None
    _rank: int | None

    def __init__(
        self, axes: Mapping[str, int] | Iterable[tuple[str, int]], *, simulate: bool = False
    ) -> None:
        object.__setattr__(self, "_axes", _parse_axes(axes))
        if not isinstance(simulate, (bool, int)):
            raise fail(
                f"Mesh(simulate={shown(simulate)}): simulate is True or False.",
                "pass simulate=True for virtual devices in this process, False (default) under torchrun.",
            )
        object.__setattr__(self, "_simulate", bool(simulate))
        object.__setattr__(self, "_device_mesh", None)
        object.__setattr__(self, "_rank", None)
        if not simulate:
            rank, device_mesh = _connect(self)
            object.__setattr__(self, "_rank", rank)
            object.__setattr__(self, "_device_mesh", device_mesh)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Mesh is immutable")

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._axes)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, major first."""
        return dict(self._axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self._axes)

    @property
    def size(self) -> int:
        """Number of devices."""
        return math.prod(self.sizes)

    @property
    def simulated(self) -> bool:
        return self._simulate

    def axis_size(self, name: str | tuple[str, ...]) -> int:
        """Size of one axis, or the product of several."""
        names = (name,) if isinstance(name, str) else tuple(name)
        for n in names:
            if n not in self.shape:
                raise fail(
                    f"Mesh.axis_size({name!r}): the mesh has no axis {n!r}; its axes are "
                    f"{list(self.axis_names)}.",
                    f"use one of {list(self.axis_names)}.",
                )
        return math.prod(self.shape[n] for n in names)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along every axis."""
        self._check_rank(rank)
        out: dict[str, int] = {}
        for name, size in reversed(self._axes):
            out[name] = rank % size
            rank //= size
        return dict(reversed(list(out.items())))

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of :meth:`coords`."""
        rank = 0
        if missing := [n for n, _ in self._axes if n not in coords]:
            raise fail(
                f"Mesh.rank_of({shown(dict(coords))}): no coordinate for axis/axes {missing}.",
                f"give one coordinate per axis of {self.describe()}.",
            )
        for name, size in self._axes:
            c = coords[name]
            if not 0 <= c < size:
                raise fail(
                    f"Mesh.rank_of({shown(dict(coords))}): coordinate {c} is outside axis "
                    f"{name!r} of size {size}.",
                    f"use 0 <= {name} < {size}.",
                )
            rank = rank * size + c
        return rank

    def axis_index(self, rank: int, axes: str | tuple[str, ...]) -> int:
        """Position of ``rank`` within its group over ``axes`` (first axis major)."""
        coords = self.coords(rank)
        index = 0
        for name in (axes,) if isinstance(axes, str) else axes:
            index = index * self.shape[name] + coords[name]
        return index

    def groups(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """The rank groups that communicate over ``axes``; each ordered by :meth:`axis_index`."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        self.axis_size(names)
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.size):
            c = self.coords(rank)
            key = tuple(c[n] for n in self.axis_names if n not in names)
            by_rest.setdefault(key, []).append(rank)
        return [sorted(g, key=lambda r: self.axis_index(r, names)) for g in by_rest.values()]

    def group_of(self, rank: int, axes: str | tuple[str, ...]) -> list[int]:
        """The ranks ``rank`` communicates with over ``axes``, ordered by axis index."""
        return next(g for g in self.groups(axes) if rank in g)

    @property
    def rank(self) -> int:
        """This process's rank (real mode only)."""
        if self._rank is None:
            raise fail(
                f"{self!r} is simulated: it has {self.size} virtual devices and no own rank.",
                "iterate over range(mesh.size) or build the mesh with simulate=False under torchrun.",
            )
        return self._rank

    @property
    def device_mesh(self) -> DeviceMesh:
        """The torch DeviceMesh with ``mesh_dim_names`` (real mode only)."""
        if self._device_mesh is None:
            raise fail(
                f"{self!r} is simulated and has no torch DeviceMesh.",
                "build the mesh with simulate=False under torchrun.",
            )
        return self._device_mesh

    def describe(self) -> str:
        """``dp=2 x tp=4`` — the axes in one phrase."""
        return " x ".join(f"{n}={s}" for n, s in self._axes)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise fail(
                f"rank {shown(rank)} is not a device of {self!r} (ranks 0..{self.size - 1}).",
                f"pass an int rank in 0..{self.size - 1}.",
            )

    def _key(self) -> tuple[object, ...]:
        return (self._axes, self._simulate)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("Mesh", *self._key()))

    def __reduce__(self) -> tuple[Any, tuple[object, ...]]:
        return (_rebuild, (self._axes, self._simulate))

    def __repr__(self) -> str:
        axes = "{" + ", ".join(f"{n!r}: {s}" for n, s in self._axes) + "}"
        return f"Mesh({axes}, simulate=True)" if self._simulate else f"Mesh({axes})"

    def __str__(self) -> str:
        kind = "simulated" if self._simulate else "real"
        head = f"Mesh {self.describe()} ({self.size} {kind} device{'s' if self.size != 1 else ''})"
        return head + "\n" + _rank_grid(self)


def _rebuild(axes: tuple[tuple[str, int], ...], simulate: bool) -> Mesh:
    return Mesh(axes, simulate=simulate)


def _rank_grid(mesh: Mesh) -> str:
    """Ranks laid out by coordinate: rows = second-to-last axis, columns = last axis."""
    names, sizes = mesh.axis_names, mesh.sizes
    col_name, cols = names[-1], sizes[-1]
    row_name, rows = (names[-2], sizes[-2]) if len(names) > 1 else ("", 1)
    blocks = math.prod(sizes[:-2]) if len(names) > 2 else 1
    width = max(len(str(mesh.size - 1)), len(f"{col_name}={cols - 1}"))
    label_w = len(f"{row_name}={rows - 1}") if row_name else 0
    lines: list[str] = []
    for b in range(blocks):
        base = b * rows * cols
        if len(names) > 2:
            lead = mesh.coords(base)
            lines.append("  [" + ", ".join(f"{n}={lead[n]}" for n in names[:-2]) + "]")
        lines.append("  " + " " * label_w + "".join(f"  {f'{col_name}={c}':>{width}}" for c in range(cols)))
        for r in range(rows):
            label = f"{row_name}={r}" if row_name else ""
            cells = "".join(f"  {base + r * cols + c:>{width}}" for c in range(cols))
            lines.append(f"  {label:<{label_w}}{cells}")
    return "\n".join(lines)


def _leave_group() -> None:
    """At exit, tear down the process group this module made (when the program has not): left to
    the interpreter's teardown, gloo's threads outlive the group's owner and a rank can abort
    ('terminate called without an active exception') after its work is done."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:  # no rank tears down its connections while a peer still reads from them
        if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    except Exception:  # a peer died or never arrives: nothing left to wait for
        pass
    dist.destroy_process_group()


def _connect(mesh: Mesh) -> tuple[int, DeviceMesh]:
    """Join (or start) torch.distributed and build the DeviceMesh for a real mesh."""
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError as exc:  # pragma: no cover - torch builds without distributed
        raise fail(
            f"{mesh!r}: real mode needs torch.distributed, which this torch build lacks ({exc}).",
            "install a torch build with distributed support, or pass simulate=True.",
        ) from None
    if not dist.is_available():
        raise fail(
            f"{mesh!r}: real mode needs torch.distributed, which this torch build lacks "
            "(torch.distributed.is_available() is False).",
            "install a torch build with distributed support, or pass simulate=True.",
        )
    if dist.is_initialized():
        world, source = dist.get_world_size(), "the already initialized default process group"
    else:
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise fail(
                f"{mesh!r}: real mode needs torch.distributed, which is not initialized, and the "
                f"torchrun environment variables {missing} are not set.",
                f"launch with `torchrun --nproc-per-node={mesh.size} your_script.py`, call "
                "torch.distributed.init_process_group() before building the Mesh, or pass "
                "simulate=True for virtual devices in this process.",
            )
        world, source = int(os.environ["WORLD_SIZE"]), "the WORLD_SIZE environment variable"
    if world != mesh.size:
        raise fail(
            f"{mesh!r} has {mesh.describe()} = {mesh.size} devices, but the world size is {world} "
            f"(from {source}).",
            f"launch {mesh.size} processes (torchrun --nproc-per-node={mesh.size}) or change the "
            f"axis sizes so their product is {world}.",
        )
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:
            dist.init_process_group(backend)
        else:
            # torchrun keeps one store across restarts: key this attempt apart, or a restarted group
            # would read the dead workers' addresses and fail to connect
            from torch.distributed import PrefixStore  # type: ignore[attr-defined]
            from torch.distributed.rendezvous import rendezvous

            store, rank, size = next(rendezvous("env://"))
            prefixed = PrefixStore(f"shardspec-attempt-{attempt}/", store)
            dist.init_process_group(backend, store=prefixed, rank=rank, world_size=size)
        # every rank connected before any goes on: gloo's handshake is one-sided, so a rank that
        # finished quickly and tore its group down failed a peer still connecting
        dist.barrier()
        atexit.register(_leave_group)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = init_device_mesh(device_type, mesh.sizes, mesh_dim_names=mesh.axis_names)
    return dist.get_rank(), device_mesh
