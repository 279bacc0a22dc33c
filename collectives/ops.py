"""The collectives as torch custom ops (namespace ``shardspec``), so graphs record them as one node.

Schemas take keyword-only arguments, so a traced graph prints e.g.
``torch.ops.shardspec.all_gather.default(x, dim = 0, axis = 'tp', mesh = 'dp=2,tp=2')``. The mesh
travels as its key (``mesh_key``) because op schemas cannot carry Python objects; ``axis`` is one
name or several joined by commas. Every op allocates its output (no input is mutated or aliased),
except ``wait``, which returns its input once the async collective that produces it is complete, and
``all_reduce_inplace``, which reduces a buffer the program owns in place (compiler passes use it on
gradient buckets, saving the output allocation and copy of ``all_reduce``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx.node

from collectives import accounting, distributed, simulated
from shardspec.errors import fail
from shardspec.layout import chunk_bounds
from shardspec.mesh import Mesh

_meshes: dict[str, Mesh] = {}


def mesh_key(mesh: Mesh) -> str:
    """A string naming ``mesh`` in op arguments; registers it for lookup."""
    key = ",".join(f"{n}={s}" for n, s in mesh.shape.items()) + (";sim" if mesh.simulated else "")
    _meshes[key] = mesh
    return key


def mesh_of(key: str) -> Mesh:
    try:
        return _meshes[key]
    except KeyError:
        raise fail(
            f"collective names mesh {key!r}, which this process has not built.",
            "build the Mesh in this process before running a program that uses it.",
        ) from None


_FAKE_RANK: contextvars.ContextVar[int | None] = contextvars.ContextVar("shardspec_fake_rank", default=None)


@contextlib.contextmanager
def fake_rank(rank: int) -> Iterator[None]:
    """Shape propagation of ``rank``'s own program: the fake kernels of the ops whose result is
    this rank's block (local_slice, reduce_scatter, all_to_all) give that block's size, so an
    uneven layout's shorter block propagates. Outside it they give block 0's, the largest."""
    token = _FAKE_RANK.set(rank)
    try:
        yield
    finally:
        _FAKE_RANK.reset(token)


def _block(n: int, mesh: str, axis: str) -> int:
    """The fake result's length along a dim of ``n`` split over ``axis`` (see ``fake_rank``)."""
    m, axes = mesh_of(mesh), _axes(axis)
    rank = _FAKE_RANK.get()
    if rank is None or not 0 <= rank < m.size:
        return -(-n // m.axis_size(axes))
    start, stop = chunk_bounds(n, m.axis_size(axes), m.axis_index(rank, axes))
    return stop - start


def _axes(axis: str) -> tuple[str, ...]:
    return tuple(axis.split(","))


def _run(kind: str, x: torch.Tensor, mesh: str, axis: str, **params: Any) -> torch.Tensor:
    m, axes = mesh_of(mesh), _axes(axis)
    if m.simulated:
        ctx = simulated.current()
        if ctx is None:
            raise fail(
                f"{kind} on simulated {m!r} got one tensor outside a simulated SPMD run, so "
                "it cannot tell which virtual device it belongs to.",
                "pass a list with one tensor per device (results come back the same way), "
                "or call it inside collectives.run_simulated(fn, mesh).",
            )
        world, rank = ctx
        return world.collective(rank, kind, axes, x, params)
    fn = getattr(distributed, kind)
    return fn(m, axes, x, **params)  # type: ignore[no-any-return]


def _opt(size: int) -> int | None:
    return None if size < 0 else size


@torch.library.custom_op("shardspec::all_gather", mutates_args=())
def all_gather(
    x: torch.Tensor, *, dim: int, axis: str, mesh: str, size: int = -1, async_op: bool = False
) -> torch.Tensor:
    params: dict[str, Any] = {"dim": dim, "size": _opt(size)}
    if not mesh_of(mesh).simulated:
        params["async_op"] = async_op
    out = _run("all_gather", x, mesh, axis, **params)
    if async_op and mesh_of(mesh).simulated:
        simulated.hold(out, x)  # read until its wait on c10d too (all_reduce copies it at launch)
    return out


@all_gather.register_fake
def _(
    x: torch.Tensor, *, dim: int, axis: str, mesh: str, size: int = -1, async_op: bool = False
) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size if size >= 0 else shape[dim] * mesh_of(mesh).axis_size(_axes(axis))
    return x.new_empty(shape)


@torch.library.custom_op("shardspec::reduce_scatter", mutates_args=())
def reduce_scatter(
    x: torch.Tensor, *, dim: int, axis: str, mesh: str, op: str = "sum", async_op: bool = False
) -> torch.Tensor:
    params: dict[str, Any] = {"dim": dim, "op": op}
    if not mesh_of(mesh).simulated:
        params["async_op"] = async_op
    out = _run("reduce_scatter", x, mesh, axis, **params)
    if async_op and mesh_of(mesh).simulated:
        simulated.hold(out, x)  # read until its wait on c10d too (all_reduce copies it at launch)
    return out


@reduce_scatter.register_fake
def _(
    x: torch.Tensor, *, dim: int, axis: str, mesh: str, op: str = "sum", async_op: bool = False
) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = _block(shape[dim], mesh, axis)
    return x.new_empty(shape)


@torch.library.custom_op("shardspec::all_reduce", mutates_args=())
def all_reduce(
    x: torch.Tensor, *, axis: str, mesh: str, op: str = "sum", async_op: bool = False
) -> torch.Tensor:
    params: dict[str, Any] = {"op": op}
    if not mesh_of(mesh).simulated:
        params["async_op"] = async_op
    return _run("all_reduce", x, mesh, axis, **params)


@all_reduce.register_fake
def _(x: torch.Tensor, *, axis: str, mesh: str, op: str = "sum", async_op: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("shardspec::all_to_all", mutates_args=())
def all_to_all(
    x: torch.Tensor, *, split_dim: int, concat_dim: int, axis: str, mesh: str, size: int = -1
) -> torch.Tensor:
    params: dict[str, Any] = {"split_dim": split_dim, "concat_dim": concat_dim, "size": _opt(size)}
    return _run("all_to_all", x, mesh, axis, **params)


@all_to_all.register_fake
def _(
    x: torch.Tensor, *, split_dim: int, concat_dim: int, axis: str, mesh: str, size: int = -1
) -> torch.Tensor:
    n = mesh_of(mesh).axis_size(_axes(axis))
    shape = list(x.shape)
    shape[split_dim] = _block(shape[split_dim], mesh, axis)
    shape[concat_dim] = size if size >= 0 else shape[concat_dim] * n
    return x.new_empty(shape)


@torch.library.custom_op("shardspec::ppermute", mutates_args=())
def ppermute(x: torch.Tensor, *, axis: str, perm: list[int], mesh: str) -> torch.Tensor:
    pairs = [(perm[i], perm[i + 1]) for i in range(0, len(perm), 2)]
    return _run("ppermute", x, mesh, axis, perm=pairs)


@ppermute.register_fake
def _(x: torch.Tensor, *, axis: str, perm: list[int], mesh: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("shardspec::broadcast", mutates_args=())
def broadcast(x: torch.Tensor, *, axis: str, src: int, mesh: str) -> torch.Tensor:
    return _run("broadcast", x, mesh, axis, src=src)


@broadcast.register_fake
def _(x: torch.Tensor, *, axis: str, src: int, mesh: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("shardspec::send", mutates_args=())
def send(x: torch.Tensor, *, axis: str, dst: int, mesh: str) -> None:
    m, axes = mesh_of(mesh), _axes(axis)
    if m.simulated:
        world, rank = _sim_context("send", m)
        group = m.group_of(rank, axes)
        accounting.record("send", axes, x, tuple(group), {rank: accounting.p2p_bytes(x, True)})
        world.send(rank, group[dst], x)
        return
    distributed.send(m, axes, x, dst)


@send.register_fake
def _(x: torch.Tensor, *, axis: str, dst: int, mesh: str) -> None:
    return None


@torch.library.custom_op("shardspec::recv", mutates_args=())
def recv(
    *, shape: list[int], dtype: torch.dtype, device: torch.device, axis: str, src: int, mesh: str
) -> torch.Tensor:
    m, axes = mesh_of(mesh), _axes(axis)
    if m.simulated:
        world, rank = _sim_context("recv", m)
        group = m.group_of(rank, axes)
        got = world.recv(rank, group[src])
        accounting.record("recv", axes, got, tuple(group), {rank: 0})
        if list(got.shape) != list(shape) or got.dtype != dtype:
            raise fail(
                f"recv on rank {rank}: expected {tuple(shape)} {dtype}, the sender sent "
                f"{tuple(got.shape)} {got.dtype}.",
                "make send and recv agree on shape and dtype.",
            )
        return got.to(device)
    return distributed.recv(m, axes, torch.empty(shape, dtype=dtype, device=device), src)


@recv.register_fake
def _(
    *, shape: list[int], dtype: torch.dtype, device: torch.device, axis: str, src: int, mesh: str
) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@torch.library.custom_op("shardspec::local_slice", mutates_args=())
def local_slice(x: torch.Tensor, *, dim: int, axis: str, mesh: str) -> torch.Tensor:
    """This rank's torch.chunk block of ``dim`` over ``axis``: Replicate -> Shard, no communication."""
    m, axes = mesh_of(mesh), _axes(axis)
    if m.simulated:
        _, rank = _sim_context("local_slice", m)
    else:
        rank = m.rank
    start, stop = chunk_bounds(x.shape[dim], m.axis_size(axes), m.axis_index(rank, axes))
    return x.narrow(dim, start, stop - start).clone()


@local_slice.register_fake
def _(x: torch.Tensor, *, dim: int, axis: str, mesh: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = _block(shape[dim], mesh, axis)
    return x.new_empty(shape)


# point-to-point ops pair up across ranks: never drop one as dead code
torch.fx.node._side_effectful_functions.add(torch.ops.shardspec.send.default)
torch.fx.node._side_effectful_functions.add(torch.ops.shardspec.recv.default)

_lib = torch.library.Library("shardspec", "FRAGMENT")  # type: ignore[no-untyped-call]
_lib.define("wait(Tensor(a) x) -> Tensor(a)")  # type: ignore[no-untyped-call]


_lib.define(  # type: ignore[no-untyped-call]
    "all_reduce_inplace(Tensor(a!) x, *, str axis, str mesh, str op='sum', bool async_op=False) -> Tensor(a!)"
)


def _all_reduce_inplace_impl(
    x: torch.Tensor, *, axis: str, mesh: str, op: str = "sum", async_op: bool = False
) -> torch.Tensor:
    m = mesh_of(mesh)
    if m.simulated:
        x.copy_(_run("all_reduce", x, mesh, axis, op=op))
        return x
    return distributed.all_reduce_inplace(m, _axes(axis), x, op, async_op)


def _all_reduce_inplace_meta(
    x: torch.Tensor, *, axis: str, mesh: str, op: str = "sum", async_op: bool = False
) -> torch.Tensor:
    return x


_lib.impl("all_reduce_inplace", _all_reduce_inplace_impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
_lib.impl("all_reduce_inplace", _all_reduce_inplace_meta, "Meta")  # type: ignore[no-untyped-call]


def _wait_impl(x: torch.Tensor) -> torch.Tensor:
    distributed.wait(x)
    simulated.release(x)
    return x


_lib.impl("wait", _wait_impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
_lib.impl("wait", lambda x: x, "Meta")  # type: ignore[no-untyped-call]


def _sim_context(kind: str, m: Mesh) -> tuple[simulated.SimulatedWorld, int]:
    ctx = simulated.current()
    if ctx is None:
        raise fail(
            f"{kind} on simulated {m!r} runs point to point between virtual devices and "
            "needs their SPMD threads.",
            "call it inside collectives.run_simulated(fn, mesh).",
        )
    return ctx
