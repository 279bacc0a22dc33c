"""Collectives between the processes of one host, read straight from each other's memory.

Why: gloo moves every byte through loopback TCP. The kernel copies each block into a socket and out
again, and every step of gloo's protocol hands work between threads, whose wake-ups cost from a tenth
of a millisecond to several on a busy machine. Linux's cross-memory attach (``process_vm_readv``, the
large-message path of MPI's shared-memory transports) copies a range of another process's memory into
this one's in one kernel copy. The members meet at a 4 KiB control block in shared memory: a sequence
number and a buffer address per member, read by spinning (then sleeping) until every member has
arrived. No data buffer is shared or mapped, so no rank's resident memory grows by its peers' buffers.

A collective is the same steps on every member of the group:

1. each publishes its buffer's address and waits until every member has (the data is ready);
2. each reads what it needs from the others' buffers. An all-reduce first combines its own block of
   every member's buffer (in group position order, as the simulated mesh does), then, after a second
   meeting, reads the others' combined blocks: one rank combines each block, so all hold equal values;
3. a last meeting: no member may change its buffer before every peer has read it.

Each member reads the blocks the ring formulas count, so accounting is unchanged. A gloo group takes
this path when every member runs on this host (same hostname, boot and PID namespace, x86-64, whose
stores become visible in program order), the control block can be made in ``/dev/shm``, and a probe
read between the members succeeds (a container may forbid it); ``SHARDSPEC_SAME_HOST=0`` turns it off
(the members agree on the outcome: a member with it off turns it off for the group). On such a group
``all_reduce`` takes it, and ``all_gather`` and ``reduce_scatter`` of even blocks in a group whose
c10d order is its position order, however small (a meeting is a few microseconds where a gloo round
trip is a fraction of a millisecond); uneven or reordered gathers and scatters, ``all_to_all``,
``broadcast``, ``ppermute`` and send/recv stay on gloo. Every decision depends only on what the
members share, so all take the same path. A collective runs when it is called, in issue order as c10d
requires, an ``async_op`` one too (``Done`` holds its buffers until its wait): the transfer is several
times faster than gloo's but does not overlap compute, and issuing waits for the peers to issue.
Waiting for a peer spins, then sleeps, and checks now and then that the late peers' processes still
exist: a peer that exited (also while being read) is an error at once, one that never arrives an
error at the step's timeout (outside a step, the group's).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import socket
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardspec.errors import fail

PIECE_BYTES = 1 << 18  # combine in pieces that stay in cache between the read and the add
ENV = "SHARDSPEC_SAME_HOST"
SLOT = 8  # int64 words per member in the control block (a cache line): sequence, address, and
# two halves of (tag, word) for ``Host.exchange``
NO_ADDRESS = -1  # published by an exchange, which has no buffer
_SHM = Path("/dev/shm")
_PREFIX = "shardspec-"

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_COMBINE: dict[str, Callable[..., torch.Tensor]] = {
    "sum": torch.add,
    "avg": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
}
_readv: list[Any] = []


class Host:
    """One group's meeting place: the members' pids (c10d order), the shared control block, and
    the group's own timeout (for collectives called outside a step)."""

    def __init__(self, rank: int, pids: tuple[int, ...], block: mmap.mmap, timeout: float) -> None:
        self.rank, self.pids, self.n, self.timeout = rank, pids, len(pids), timeout
        self._block = block  # kept mapped for the slots' view
        self._slots = memoryview(block).cast("q")
        self._seq = 0

    def meet(self, address: int | None = None) -> list[int]:
        """Wait for every member to reach the same meeting; the addresses they published. Only a
        collective's first meeting publishes one: a peer still reading this collective's addresses
        has not passed its last meeting, which a next collective's first one follows."""
        self._seq += 1
        slots, mine = self._slots, self.rank * SLOT
        if address is not None:
            slots[mine + 1] = address
        slots[mine] = self._seq  # after the address (and the data): x86-64 keeps the store order
        self._wait_all()
        got = [slots[r * SLOT + 1] for r in range(self.n)]
        if address is not None and NO_ADDRESS in got:
            raise _crossed(got.index(NO_ADDRESS))
        return got

    def exchange(self, word: int, limit: float) -> list[int] | None:
        """Every member's ``word`` (an int64), at one meeting held in the control block: no buffer
        is read, so a small agreement costs microseconds where a gloo round trip costs a fraction
        of a millisecond. None when some member reached this meeting in another collective (the
        ranks' calls differ). ``limit``: seconds to wait, then ``TimeoutError``.

        Each member writes its word and this meeting's number as a tag into one of two halves of
        its slot, by the meeting's parity: a peer still reading the previous exchange's half has
        not reached the meeting between, which this member had to pass first."""
        self._seq += 1
        slots, mine, half = self._slots, self.rank * SLOT, 2 + 2 * (self._seq & 1)
        slots[mine + 1] = NO_ADDRESS  # a peer in another collective fails instead of reading garbage
        slots[mine + half], slots[mine + half + 1] = self._seq, word
        slots[mine] = self._seq  # after the word: x86-64 keeps the store order
        self._wait_all(limit)
        if any(slots[r * SLOT + half] != self._seq for r in range(self.n)):
            return None
        return [slots[r * SLOT + half + 1] for r in range(self.n)]

    def _wait_all(self, limit: float | None = None) -> None:
        """Spin until every member's sequence number reaches this meeting's; after a few hundred
        microseconds sleep between looks, so a late peer (or one sharing this core) gets the CPU,
        and check now and then that the late peers' processes still exist. Past ``limit`` seconds
        (the running step's timeout, or the group's, when None) the wait is an error."""
        slots, seq, n = self._slots, self._seq, self.n
        started = checked = 0.0
        spins = 0
        while any(slots[r * SLOT] < seq for r in range(n)):
            spins += 1
            if spins < 500:
                continue
            now = time.monotonic()
            started = started or now
            waited = now - started
            if waited > (bound := self._limit() if limit is None else limit):
                if limit is not None:
                    raise TimeoutError(limit)
                raise _expired(bound, "a peer never reached a same-host collective")
            if now - checked > 0.01:
                checked = now
                for r in range(n):
                    if slots[r * SLOT] < seq and not _alive(self.pids[r]):
                        from collectives import distributed

                        raise distributed.peer_exited(r, self.pids[r])
            time.sleep(0 if waited < 1e-3 else 5e-5 if waited < 0.1 else 1e-3)

    def _limit(self) -> float:
        from collectives import distributed

        seconds = distributed.wait_seconds()  # the running step's timeout
        return seconds if seconds is not None else self.timeout


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie its parent has not reaped yet,
    as a launcher's child is until the launcher looks, counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc to read: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] not in ("Z", "X")


def _crossed(rank: int) -> Exception:
    """The error of a collective whose peer reached the same meeting in an agreement exchange."""
    from collectives import distributed

    distributed.mark_broken("a collective met another kind of collective on a peer.")
    return fail(
        f"a collective met group rank {rank} in a call's rank-agreement check instead of the same "
        "collective: the ranks' calls differ (this rank calls a collective of its own where that rank "
        "calls a sharded step or a checkpoint save or load). This process group cannot run another "
        "collective.",
        "make every rank of the mesh make the same calls in the same order (no `if rank == 0:` around "
        "a collective call) and start the job again.",
    )


def _expired(seconds: float, detail: str) -> Exception:
    from collectives import distributed

    return distributed.timed_out(seconds, detail)


class Done:
    """A collective issued with ``async_op`` that already ran: it holds its buffers until its wait,
    as gloo's work does (what the memory model counts). It ran when issued, in issue order, which
    c10d already requires to match across ranks; waits may then come in any order on any rank."""

    def __init__(self, *keep: torch.Tensor) -> None:
        self._keep = keep

    def wait(self, timeout: object = None) -> bool:
        self._keep = ()
        return True


# group -> (the process that probed it, its meeting place or None); weak: a destroyed group goes,
# and a new group at its address is probed anew (keyed by address, one rank could find a stale entry)
_hosts: weakref.WeakKeyDictionary[Any, tuple[int, Host | None]] = weakref.WeakKeyDictionary()


def probed(pg: Any) -> Host | None:
    """The group's meeting place if this process has probed the group already, else None (never
    probes: a probe is a collective, which only a point every member reaches may start)."""
    entry = _hosts.get(pg)
    return entry[1] if entry is not None and entry[0] == os.getpid() else None


def host(pg: Any, device: torch.device, finish: Callable[[Any], None] | None = None) -> Host | None:
    """The group's meeting place for a buffer on ``device``, or None (gloo's own collectives). The
    first collective on a group probes it (a collective call on every member); a forked child
    probes anew. ``finish`` completes the probe's collectives (default: as a step's collective)."""
    if device.type != "cpu" or dist.get_backend(pg) != "gloo":
        return None
    entry = _hosts.get(pg)
    if entry is None or entry[0] != os.getpid():
        entry = _hosts[pg] = (os.getpid(), _probe(pg, finish))
    return entry[1]


def _host_key() -> int:
    """Equal for two processes only if they share the host, its boot and the PID namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return int.from_bytes(os.urandom(7), "little")  # cannot tell: never equal to another's
    digest = hashlib.sha256(f"{socket.gethostname()} {boot} {namespace}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _reader() -> Any:
    """libc's ``process_vm_readv``, or None where there is none (not Linux)."""
    if not _readv:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
            except (OSError, AttributeError):
                fn = None
        if fn is not None:
            vec = ctypes.POINTER(_IoVec)
            fn.argtypes = [ctypes.c_int, vec, ctypes.c_ulong, vec, ctypes.c_ulong, ctypes.c_ulong]
            fn.restype = ctypes.c_ssize_t
        _readv.append(fn)
    return _readv[0]


def _read_from(h: Host, r: int, dst: int, src: int, nbytes: int) -> None:
    """``_read`` from group rank ``r``: a peer that exited meanwhile is the peer-exited error."""
    try:
        _read(h.pids[r], dst, src, nbytes)
    except OSError:
        if not _alive(h.pids[r]):
            from collectives import distributed

            raise distributed.peer_exited(r, h.pids[r]) from None
        raise


def _read(pid: int, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` at address ``src`` of process ``pid`` to ``dst`` here."""
    fn = _reader()
    while nbytes > 0:
        local, remote = _IoVec(dst, nbytes), _IoVec(src, nbytes)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        dst, src, nbytes = dst + got, src + got, nbytes - got


def _pattern(pid: int) -> list[int]:
    return [pid, pid ^ 0x5EED5EED5EED, -pid]


def _probe(pg: Any, finish: Callable[[Any], None] | None) -> Host | None:
    """Every member on this host, able to read the others' memory and to map the control block
    member 0 made: agreed by all (gloo round trips, once per group). Member 0 removes its file once
    every member has mapped it, or given up, or when the exchange raises."""
    rank, n = dist.get_rank(pg), dist.get_world_size(pg)
    enabled = (
        os.environ.get(ENV, "1") != "0"
        and _reader() is not None
        and platform.machine() in ("x86_64", "AMD64")
        and _SHM.is_dir()
    )
    token = int.from_bytes(os.urandom(7), "little")
    path = _SHM / f"{_PREFIX}{os.getpid()}-{token:x}"
    if rank == 0 and enabled:
        _remove_stale()
    block = _create(path, 4096) if rank == 0 and enabled else None
    try:
        rows, mapped = _exchange(pg, rank, n, enabled and (rank > 0 or block is not None), token, finish)
    finally:
        if block is not None:
            path.unlink(missing_ok=True)
    block = block if rank == 0 else mapped
    if block is None or not rows:
        return None
    return Host(rank, tuple(row[0] for row in rows), block, _group_timeout(pg))


def _exchange(
    pg: Any, rank: int, n: int, able: bool, token: int, finish: Callable[[Any], None] | None
) -> tuple[list[list[int]], mmap.mmap | None]:
    """Every member's (pid, host key, able, probe address, token) where all agreed that every
    member is on this host and reads every other's probe (else no rows), and, on members other
    than 0, member 0's control block, mapped before the agreement completes."""
    from collectives.distributed import _finish

    done = finish or _finish
    probe = torch.tensor(_pattern(os.getpid()), dtype=torch.int64)
    mine = [os.getpid(), _host_key(), int(able), probe.data_ptr(), token]
    table = torch.empty(len(mine) * n, dtype=torch.int64)
    done(_all_gather_flat(table, torch.tensor(mine, dtype=torch.int64), group=pg, async_op=True))
    rows = table.view(n, len(mine)).tolist()
    ok = all(row[1] == rows[0][1] and row[2] for row in rows)
    mapped = None
    if ok and rank > 0:
        mapped = _open(_SHM / f"{_PREFIX}{rows[0][0]}-{rows[0][4]:x}", 4096)
        ok = mapped is not None
    got = torch.empty_like(probe)
    for r, row in enumerate(rows):
        if ok and r != rank:
            try:
                _read(row[0], got.data_ptr(), row[3], got.nbytes)
            except OSError:
                ok = False
            ok = ok and got.tolist() == _pattern(row[0])
    agreed = torch.tensor([int(ok)], dtype=torch.int64)
    done(dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=pg, async_op=True))  # after every read
    return (rows, mapped) if agreed.item() else ([], None)


def _group_timeout(pg: Any) -> float:
    """The timeout the group was made with (c10d's default where it cannot be read)."""
    try:
        return float(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:
        return dist.default_pg_timeout.total_seconds()


def _remove_stale() -> None:
    """Control-block files a process that died mid-probe left behind (its pid no longer exists)."""
    for old in _SHM.glob(f"{_PREFIX}*"):
        pid = old.name[len(_PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            old.unlink(missing_ok=True)


def _create(path: Path, size: int) -> mmap.mmap | None:
    if not size:
        return None
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    finally:
        os.close(fd)


def _open(path: Path, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _combine_block(
    dest: torch.Tensor, h: Host, addresses: list[int], offset: int, op: str, order: list[int]
) -> None:
    """``dest`` (this rank's copy of one block, ``offset`` bytes into each member's buffer) becomes
    the block of every member combined left to right in ``order`` (c10d ranks in group position
    order), as the simulated mesh combines: ``maximum`` of -0.0 and 0.0 depends on it, and so do
    sums of more than two. Two-member sums are the same either way round (IEEE addition commutes)."""
    combine = _COMBINE[op]
    if op in ("sum", "avg") and h.n == 2:
        order = [h.rank, *(r for r in order if r != h.rank)]
    step = max(1, PIECE_BYTES // dest.element_size())
    got = torch.empty(min(step, dest.numel()), dtype=dest.dtype)
    acc = got if order[0] == h.rank else torch.empty_like(got)
    for a in range(0, dest.numel(), step):
        mine = dest[a : a + step]
        where = offset + a * dest.element_size()
        part, total = got[: mine.numel()], (mine if order[0] == h.rank else acc[: mine.numel()])
        for i, r in enumerate(order):
            if r == h.rank:
                if i:
                    combine(total, mine, out=total)
                continue
            into = total if i == 0 else part
            _read_from(h, r, into.data_ptr(), addresses[r] + where, mine.nbytes)
            if i:
                combine(total, part, out=total)
        if total is not mine:
            mine.copy_(total)


def all_reduce(h: Host, buf: torch.Tensor, op: str, order: list[int]) -> torch.Tensor:
    """Reduce the dense ``buf`` in place on every member; ``order``: see ``_combine_block``."""
    rank, n, size = h.rank, h.n, buf.element_size()
    starts = [buf.numel() * r // n for r in range(n + 1)]
    with torch.no_grad():
        flat = buf.view(-1)
        addresses = h.meet(buf.data_ptr())
        _combine_block(flat[starts[rank] : starts[rank + 1]], h, addresses, starts[rank] * size, op, order)
        h.meet()  # every block combined
        for r in range(h.n):
            if r != rank and starts[r + 1] > starts[r]:
                dst = flat[starts[r] :].data_ptr()
                _read_from(h, r, dst, addresses[r] + starts[r] * size, (starts[r + 1] - starts[r]) * size)
        h.meet()  # no member reads this buffer any more
        if op == "avg":
            buf.div_(n)
    return buf


def reduce_scatter(h: Host, front: torch.Tensor, out: torch.Tensor, op: str) -> torch.Tensor:
    """``out`` becomes this rank's block of the dense ``front``, combined over members (a group
    whose c10d order is its position order)."""
    block = out.shape[0]
    with torch.no_grad():
        out.copy_(front[h.rank * block : (h.rank + 1) * block])
        addresses = h.meet(front.data_ptr())
        _combine_block(out.view(-1), h, addresses, h.rank * out.nbytes, op, list(range(h.n)))
        h.meet()  # every member has read its block
        if op == "avg":
            out.div_(h.n)
    return out


def all_gather(h: Host, front: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (the members' dense ``front`` blocks along dim 0, c10d order) on every member."""
    length = front.shape[0]
    with torch.no_grad():
        out[h.rank * length : (h.rank + 1) * length].copy_(front)
        addresses = h.meet(front.data_ptr())
        for r in range(h.n):
            if r != h.rank:
                _read_from(h, r, out[r * length :].data_ptr(), addresses[r], front.nbytes)
        h.meet()  # every member has read this rank's block
    return out
