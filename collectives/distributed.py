"""The torch.distributed backend: c10d collectives on a process group per mesh axis or axis tuple.

Single axes use the DeviceMesh's groups; a tuple of axes gets one group per member set, created on first
use by every rank in the same order (SPMD guarantees they all get there). c10d orders a group by global
rank while a tuple of axes orders it by ``Mesh.axis_index`` (first axis major); where the two differ the
blocks are permuted before sending and after receiving. Uneven shards travel padded to the largest block
and are trimmed on arrival. ``async_op=True`` returns the output buffer at once and ``wait`` completes
it (all_gather, reduce_scatter, all_reduce); results along a dim other than 0 are returned dense (as the
fake collectives' are) and filled at the wait; layouts that need work after arrival (uneven, permuted,
``avg``, except a two-rank exchange's) and empty results complete before returning. Even reduce-scatters
in c10d order send their input as it is (no concatenated copy); ``all_reduce_inplace`` reduces a
caller-owned buffer in place. Even all-gathers and reduce-scatters on a two-rank gloo group are one
point-to-point exchange (``pairwise``: faster there than gloo's own collectives, same bytes).
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from collectives import accounting, pairwise, same_host
from shardspec.errors import fail
from shardspec.layout import chunk_bounds, chunk_sizes
from shardspec.mesh import Mesh

F = TypeVar("F", bound=Callable[..., Any])
_groups: dict[tuple[Mesh, tuple[str, ...]], dict[tuple[int, ...], Any]] = {}
_pending: dict[tuple[int, int], Any] = {}  # (storage, first element) -> work
_REDUCE = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
# torch 2.13 renamed the flat-tensor collectives (the old names warn FutureWarning on every call)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# A check issued at the start of a step's call and completed before its first collective (the
# runtime sets it; see ``gate``): every collective function below passes the gate first.
_GATE: list[Callable[[], None]] = []
_GATE_FAILED = [False]  # whether the last held check raised


def gate(check: Callable[[], None]) -> None:
    """Hold ``check`` until the next collective (or ``pass_gate``), which completes it first."""
    _GATE_FAILED[0] = False
    _GATE.append(check)


def pass_gate() -> None:
    """Complete the held checks; one that raises leaves nothing held (and says so: a check that
    fails fails on every rank alike, before any collective of the step, so the group stays usable)."""
    _GATE_FAILED[0] = False
    while _GATE:
        check = _GATE.pop(0)
        try:
            check()
        except BaseException:
            _GATE_FAILED[0] = True
            raise


# Why this process's group can run no more collectives: a step raised on this rank partway
# through its program, so peers may still wait in a collective this rank never joined (or left).
_BROKEN: list[str] = []


def gate_failed() -> bool:
    """Whether the last ``pass_gate`` raised (a symmetric failure, not a broken group)."""
    return _GATE_FAILED[0]


def mark_broken(why: str) -> None:
    if not _BROKEN:
        _BROKEN.append(why)


def check_usable(what: str) -> None:
    """Refuse a collective after a step raised partway through on this rank: posting it would
    pair with a peer's collective still waiting from that call (gloo aborts the process on the
    size mismatch, or takes the bytes as that collective's data)."""
    if _BROKEN:
        raise fail(
            f"{what}: {_BROKEN[0]} Its peers may still be waiting in one of that call's collectives, "
            "so this process group cannot run another collective: it would pair with theirs.",
            "end the job and start it again (torchrun restarts it; resume from the last "
            "checkpoint); to skip bad data, check it before the step, on every rank.",
        )


def _gated(fn: F) -> F:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _BROKEN:
            check_usable(f"collectives.{fn.__name__}")
        if _GATE:
            pass_gate()
        return fn(*args, **kwargs)

    return cast(F, run)


class _Group:
    """This rank's view of one communicating group."""

    def __init__(self, mesh: Mesh, axes: tuple[str, ...], *, needs_group: bool = True) -> None:
        self.rank = mesh.rank
        self.by_pos = mesh.group_of(self.rank, axes)  # global ranks in axis order
        self.n = len(self.by_pos)
        self.pos = self.by_pos.index(self.rank)
        members = sorted(self.by_pos)  # c10d order
        self.pos_of_grank = [self.by_pos.index(g) for g in members]
        self.identity = self.pos_of_grank == list(range(self.n))
        self.pg = _process_group(mesh, axes, tuple(members)) if needs_group else None


def _process_group(mesh: Mesh, axes: tuple[str, ...], members: tuple[int, ...]) -> Any:
    if len(axes) == 1:
        return mesh.device_mesh.get_group(axes[0])
    if len(members) == dist.get_world_size():
        return dist.group.WORLD
    key = (mesh, tuple(sorted(axes, key=mesh.axis_names.index)))
    if key not in _groups:
        _groups[key] = {tuple(sorted(g)): dist.new_group(sorted(g)) for g in mesh.groups(key[1])}
    return _groups[key][members]


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0).contiguous()


def _exchange_lengths(g: _Group, length: int, device: torch.device) -> list[int]:
    """All members' lengths along a dim, by position (metadata: counted apart)."""
    mine = torch.tensor([length], dtype=torch.int64, device=device)
    out = torch.empty(g.n, dtype=torch.int64, device=device)
    _finish(_all_gather_flat(out, mine, group=g.pg, async_op=True))
    accounting.record_metadata({g.rank: 8 * (g.n - 1)})
    by_grank = out.tolist()
    lengths = [0] * g.n
    for grank, value in enumerate(by_grank):
        lengths[g.pos_of_grank[grank]] = int(value)
    return lengths


@_gated
def all_gather(
    mesh: Mesh, axes: tuple[str, ...], x: torch.Tensor, dim: int, size: int | None, async_op: bool
) -> torch.Tensor:
    g = _Group(mesh, axes)
    lengths = chunk_sizes(size, g.n) if size is not None else _exchange_lengths(g, x.shape[dim], x.device)
    longest = max(lengths)
    accounting.record(
        "all_gather", axes, x, tuple(g.by_pos), {g.rank: accounting.all_gather_bytes(x, dim, longest, g.n)}
    )
    if g.n == 1:
        return x.clone()
    if lengths[g.pos] != x.shape[dim]:
        raise _size_mismatch("all_gather", dim, x, lengths, g)
    if longest == 0:
        return x.clone(memory_format=torch.contiguous_format)
    front = _front(x, dim)
    if front.shape[0] < longest:
        front = torch.cat([front, front.new_zeros((longest - front.shape[0], *front.shape[1:]))])
    out = front.new_empty((g.n * longest, *front.shape[1:]))
    even = all(n == longest for n in lengths)
    if even and g.identity and (h := same_host.host(g.pg, out.device)):
        same_host.all_gather(h, front, out)
        return _issued_dense(same_host.Done(front, out), out, dim, async_op)
    if even and pairwise.usable(g.pg, g.n):
        exchange = pairwise.all_gather(g.pg, g.by_pos[1 - g.pos], g.pos, front, out)
        return _issued_dense(exchange, out, dim, async_op)
    work = _all_gather_flat(out, front, group=g.pg, async_op=True)
    if async_op and even and g.identity:
        return _issued_dense(work, out, dim, async_op)
    _finish(work)
    blocks = torch.split(out, longest)
    by_pos = [blocks[grank][: lengths[g.pos_of_grank[grank]]] for grank in range(g.n)]
    ordered = [by_pos[g.pos_of_grank.index(p)] for p in range(g.n)]
    return _dense(torch.cat(ordered), dim)


def _dense(front: torch.Tensor, dim: int) -> torch.Tensor:
    """``front`` (gathered or scattered along dim 0) with that dim moved back to ``dim``, dense: the
    strides the program was compiled for (its fake values are dense), which the passes read to give
    fused kernels dense rows."""
    return front if dim == 0 else front.movedim(0, dim).contiguous()


def _issued_dense(work: Any, front: torch.Tensor, dim: int, async_op: bool) -> torch.Tensor:
    """``_issued`` for a result laid out along dim 0 (``front``) and returned along ``dim``: dense
    at once, filled at the wait (through ``.data``: the data arriving, which autograd's version
    check on the collective's output does not count as a write)."""
    if dim == 0:
        return _issued(work, front, async_op)
    result = front.new_empty(front.movedim(0, dim).shape)

    def lay_out() -> None:
        result.data.copy_(front.movedim(0, dim))

    return _issued(pairwise.Exchange([work], lay_out, (front,)), result, async_op)


@_gated
def reduce_scatter(
    mesh: Mesh, axes: tuple[str, ...], x: torch.Tensor, dim: int, op: str, async_op: bool
) -> torch.Tensor:
    g = _Group(mesh, axes)
    accounting.record(
        "reduce_scatter", axes, x, tuple(g.by_pos), {g.rank: accounting.reduce_scatter_bytes(x, dim, g.n)}
    )
    if g.n == 1:
        return x.clone() if op != "avg" else x / 1
    front = _front(x, dim)
    length = front.shape[0]
    block = -(-length // g.n)
    even = length == block * g.n
    if even and g.identity and (h := same_host.host(g.pg, front.device)):
        out = front.new_empty((block, *front.shape[1:]))
        same_host.reduce_scatter(h, front, out, op)
        return _issued_dense(same_host.Done(front, out), out, dim, async_op)
    if even and pairwise.usable(g.pg, g.n):
        out = front.new_empty((block, *front.shape[1:]))
        exchange = pairwise.reduce_scatter(g.pg, g.by_pos[1 - g.pos], g.pos, front, out, op)
        return _issued_dense(exchange, out, dim, async_op)
    if length == block * g.n and g.identity:
        send = front  # blocks already in c10d order and equal: send the input as it is
    else:
        pieces = []
        for grank in range(g.n):
            start, stop = chunk_bounds(length, g.n, g.pos_of_grank[grank])
            piece = front[start:stop]
            if stop - start < block:
                piece = torch.cat([piece, piece.new_zeros((block - (stop - start), *piece.shape[1:]))])
            pieces.append(piece)
        send = torch.cat(pieces)
    out = front.new_empty((block, *front.shape[1:]))
    start, stop = chunk_bounds(length, g.n, g.pos)
    result = out if stop - start == block else out[: stop - start]  # not a view where it is all of it
    work = _reduce_scatter_flat(out, send, op=_REDUCE[op], group=g.pg, async_op=True)
    if async_op and op != "avg" and send is front:
        return _issued_dense(work, result, dim, async_op)
    _finish(work)
    return _dense(result / g.n if op == "avg" else result, dim)


@_gated
def all_reduce(mesh: Mesh, axes: tuple[str, ...], x: torch.Tensor, op: str, async_op: bool) -> torch.Tensor:
    g = _Group(mesh, axes)
    accounting.record("all_reduce", axes, x, tuple(g.by_pos), {g.rank: accounting.all_reduce_bytes(x, g.n)})
    out = x.clone(memory_format=torch.contiguous_format)
    return _reduce_into(g, out, op, async_op)


@_gated
def all_reduce_inplace(
    mesh: Mesh, axes: tuple[str, ...], x: torch.Tensor, op: str, async_op: bool
) -> torch.Tensor:
    """All-reduce into ``x`` itself (a buffer the caller owns): no output allocation, no copy."""
    g = _Group(mesh, axes)
    accounting.record("all_reduce", axes, x, tuple(g.by_pos), {g.rank: accounting.all_reduce_bytes(x, g.n)})
    if x.is_contiguous():
        return _reduce_into(g, x, op, async_op)
    x.copy_(_reduce_into(g, x.contiguous(), op, False))  # c10d needs a dense buffer
    return x


def _reduce_into(g: _Group, buf: torch.Tensor, op: str, async_op: bool) -> torch.Tensor:
    if g.n == 1:
        return buf
    if h := same_host.host(g.pg, buf.device):
        same_host.all_reduce(h, buf, op, [g.pos_of_grank.index(p) for p in range(g.n)])
        return _issued(same_host.Done(buf), buf, async_op)
    work = dist.all_reduce(buf, op=_REDUCE[op], group=g.pg, async_op=True)
    if async_op and op != "avg":
        return _issued(work, buf, async_op)
    _finish(work)
    return buf.div_(g.n) if op == "avg" else buf


@_gated
def all_to_all(
    mesh: Mesh, axes: tuple[str, ...], x: torch.Tensor, split_dim: int, concat_dim: int, size: int | None
) -> torch.Tensor:
    g = _Group(mesh, axes)
    accounting.record(
        "all_to_all",
        axes,
        x,
        tuple(g.by_pos),
        {g.rank: accounting.all_to_all_bytes(x, split_dim, g.n, g.pos)},
    )
    if g.n == 1:
        return x.clone()
    lengths = (
        chunk_sizes(size, g.n) if size is not None else _exchange_lengths(g, x.shape[concat_dim], x.device)
    )
    if lengths[g.pos] != x.shape[concat_dim]:
        raise _size_mismatch("all_to_all", concat_dim, x, lengths, g)
    front = _front(x, split_dim)
    send, send_sizes = [], []
    for grank in range(g.n):
        start, stop = chunk_bounds(front.shape[0], g.n, g.pos_of_grank[grank])
        send.append(front[start:stop].reshape(-1))
        send_sizes.append(send[-1].numel())
    shapes = []  # each sender's block for me, in the front layout
    for grank in range(g.n):
        sender = list(x.shape)
        sender[concat_dim] = lengths[g.pos_of_grank[grank]]
        start, stop = chunk_bounds(sender[split_dim], g.n, g.pos)
        sender[split_dim] = stop - start
        shapes.append(torch.Size(sender))
    recv_sizes = [math.prod(s) for s in shapes]
    out = x.new_empty(sum(recv_sizes))
    _finish(dist.all_to_all_single(out, torch.cat(send), recv_sizes, send_sizes, group=g.pg, async_op=True))
    blocks = torch.split(out, recv_sizes)
    by_pos: list[torch.Tensor] = [x] * g.n
    for grank in range(g.n):
        moved = _moved_shape(shapes[grank], split_dim)
        by_pos[g.pos_of_grank[grank]] = blocks[grank].reshape(moved).movedim(0, split_dim)
    return torch.cat(by_pos, concat_dim)


def _issued(work: Any, result: torch.Tensor, async_op: bool) -> torch.Tensor:
    """``result`` once ``work`` completes: at once, or at ``wait(result)`` when async."""
    if async_op and result.numel():  # pending works are keyed by address: 0 for every empty one
        _pending[(result.untyped_storage().data_ptr(), result.data_ptr())] = work
    else:
        _finish(work)
    return result


def _size_mismatch(kind: str, dim: int, x: torch.Tensor, lengths: list[int], g: _Group) -> Exception:
    from shardspec.errors import fail

    return fail(
        f"{kind}: this rank (position {g.pos}) holds {x.shape[dim]} along dim {dim}, but the "
        f"given global size splits as {lengths} over the group.",
        "pass size= the global length along that dim (or omit it).",
    )


def _moved_shape(shape: torch.Size, dim: int) -> tuple[int, ...]:
    return (shape[dim], *(n for d, n in enumerate(shape) if d != dim))


@_gated
def ppermute(mesh: Mesh, axes: tuple[str, ...], x: torch.Tensor, perm: list[tuple[int, int]]) -> torch.Tensor:
    g = _Group(mesh, axes, needs_group=False)
    dsts = [d for s, d in perm if s == g.pos and d != g.pos]
    srcs = [s for s, d in perm if d == g.pos and s != g.pos]
    accounting.record("ppermute", axes, x, tuple(g.by_pos), {g.rank: accounting.p2p_bytes(x, bool(dsts))})
    keeps = any(s == d == g.pos for s, d in perm)
    fmt = torch.contiguous_format
    out = x.clone(memory_format=fmt) if keeps else torch.zeros_like(x, memory_format=fmt)
    # point to point uses global ranks on the world group: no per-group state that only some
    # ranks would create
    ops = [dist.P2POp(dist.isend, x.contiguous(), g.by_pos[d]) for d in dsts]
    ops += [dist.P2POp(dist.irecv, out, g.by_pos[s]) for s in srcs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            _finish(work)
    return out


@_gated
def broadcast(mesh: Mesh, axes: tuple[str, ...], x: torch.Tensor, src: int) -> torch.Tensor:
    g = _Group(mesh, axes)
    accounting.record(
        "broadcast", axes, x, tuple(g.by_pos), {g.rank: accounting.broadcast_bytes(x, g.n, g.pos, src)}
    )
    out = x.clone(memory_format=torch.contiguous_format)
    if g.n > 1:
        _finish(dist.broadcast(out, src=g.by_pos[src], group=g.pg, async_op=True))
    return out


# Sends in flight: c10d's blocking send waits for the matching receive, so two ranks each sending
# before receiving would deadlock where the simulated mailbox does not. Sends are posted (isend)
# and completed by ``wait_sends`` (the pipeline runtime calls it at the end of a step).
_SENDS: list[tuple[Any, torch.Tensor]] = []


@_gated
def send(mesh: Mesh, axes: tuple[str, ...], x: torch.Tensor, dst: int) -> None:
    members = mesh.group_of(mesh.rank, axes)
    accounting.record("send", axes, x, tuple(members), {mesh.rank: accounting.p2p_bytes(x, True)})
    buf = x.contiguous()
    _SENDS.append((dist.isend(buf, dst=members[dst]), buf))  # world group, global rank: see ppermute


def wait_sends() -> None:
    """Complete every posted send (their buffers are held until then)."""
    while _SENDS:
        work, _ = _SENDS.pop(0)
        _finish(work)


@_gated
def recv(mesh: Mesh, axes: tuple[str, ...], out: torch.Tensor, src: int) -> torch.Tensor:
    members = mesh.group_of(mesh.rank, axes)
    accounting.record("recv", axes, out, tuple(members), {mesh.rank: 0})
    _finish(dist.irecv(out, src=members[src]))
    return out


# How long waiting for a collective may take before it is an error naming it (a peer that raised
# and went on, or died, would otherwise leave this rank waiting): the running step's timeout on a
# CPU (gloo) mesh. None waits as c10d does: on NCCL a timed wait would block the host until the GPU
# finishes, and NCCL's watchdog ends a hung collective at the process group's timeout.
_WAIT_TIMEOUT: list[float | None] = [None]


def set_wait_timeout(seconds: float | None) -> None:
    _WAIT_TIMEOUT[0] = seconds


def wait(x: torch.Tensor) -> None:
    """Complete an async collective whose output is (a view of) ``x``; no-op otherwise."""
    storage = x.untyped_storage().data_ptr()
    work = _pending.pop((storage, x.data_ptr()), None)
    if work is not None:
        _finish(work)
        return
    # a view of a result that starts elsewhere: every collective pending on that buffer (several
    # results may share one: values the program placed in one buffer, reduced at once)
    for key in [k for k in _pending if k[0] == storage]:
        _finish(_pending.pop(key))


def wait_seconds() -> float | None:
    """The running step's timeout for a collective (None outside a step, or on NCCL)."""
    return _WAIT_TIMEOUT[0]


def timed_out(seconds: float, detail: str) -> Exception:
    """The error of a collective that did not complete within ``seconds``; the group is marked
    broken, as the collective stays posted. Worded for a step's collective, or, outside a step
    (no step timeout set), for one the program called itself."""
    mark_broken(f"a collective of a step did not complete within {seconds:g} s.")
    if _WAIT_TIMEOUT[0] is None:
        return fail(
            f"a collective did not complete within {seconds:g} s, the process group's timeout "
            f"({detail}): a peer raised, died, or fell that far behind. The collective stays posted, "
            "so this process group cannot run another collective.",
            "end the job and start it again; for ranks that are only slow, raise the group's "
            "timeout (torch.distributed.init_process_group(timeout=...)).",
        )
    return fail(
        f"a collective of the step did not complete within {seconds:g} s ({detail}): a peer "
        "raised inside the step, died, or fell that far behind. The collective stays posted, so "
        "this process group cannot run another collective.",
        "end the job and start it again (torchrun restarts it; resume from the last checkpoint); "
        "for ranks that are only slow, raise sharded(..., timeout=...).",
    )


def peer_exited(rank: int, pid: int) -> Exception:
    """The error of a collective whose peer's process has exited; the group is marked broken."""
    mark_broken("a peer of a collective exited.")
    where = "of the step " if _WAIT_TIMEOUT[0] is not None else ""
    return fail(
        f"a collective {where}cannot complete: the process of group rank {rank} (pid {pid}) has "
        "exited (it raised, was killed, or ended its program early). The collective stays posted, so "
        "this process group cannot run another collective.",
        "end the job and start it again (torchrun restarts it; resume from the last checkpoint).",
    )


def _finish(work: Any) -> None:
    """Wait for ``work`` within the running step's timeout (every collective here is issued async
    and completed through this, so none waits longer)."""
    seconds = _WAIT_TIMEOUT[0]
    if seconds is None:
        work.wait()
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as exc:
        raise timed_out(seconds, str(exc)) from None
