"""The simulated backend: every virtual device of a mesh in this process.

Two ways in. List mode: a collective called with one tensor per device returns one result per device.
SPMD mode: ``run_simulated(fn, mesh)`` runs ``fn(rank)`` on one thread per virtual device, and each
collective meets its group at a rendezvous: the last member to arrive computes every member's result
with the exact kernels, checks all members made the same call (an SPMD violation is an error, not a
wrong answer) and wakes the rest. A member that never arrives is reported at the timeout, not waited
on forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from collectives import accounting, kernels
from shardspec.errors import ShardingError
from shardspec.mesh import Mesh

Params = tuple[tuple[str, Any], ...]


def _results(kind: str, xs: Sequence[torch.Tensor], p: dict[str, Any]) -> list[torch.Tensor]:
    if kind == "all_gather":
        return kernels.all_gather(xs, p["dim"], p["size"])
    if kind == "reduce_scatter":
        return kernels.reduce_scatter(xs, p["dim"], p["op"])
    if kind == "all_reduce":
        return kernels.all_reduce(xs, p["op"])
    if kind == "all_to_all":
        return kernels.all_to_all(xs, p["split_dim"], p["concat_dim"], p.get("size"))
    if kind == "ppermute":
        return kernels.ppermute(xs, p["perm"])
    if kind == "broadcast":
        return kernels.broadcast(xs, p["src"])
    raise AssertionError(kind)


def _bytes(kind: str, xs: Sequence[torch.Tensor], p: dict[str, Any]) -> list[float]:
    n = len(xs)
    if kind == "all_gather":
        longest = max(x.shape[p["dim"]] for x in xs)
        return [accounting.all_gather_bytes(x, p["dim"], longest, n) for x in xs]
    if kind == "reduce_scatter":
        return [accounting.reduce_scatter_bytes(x, p["dim"], n) for x in xs]
    if kind == "all_reduce":
        return [accounting.all_reduce_bytes(x, n) for x in xs]
    if kind == "all_to_all":
        return [accounting.all_to_all_bytes(x, p["split_dim"], n, i) for i, x in enumerate(xs)]
    if kind == "ppermute":
        senders = {s for s, d in p["perm"] if s != d}
        return [accounting.p2p_bytes(x, i in senders) for i, x in enumerate(xs)]
    if kind == "broadcast":
        return [accounting.broadcast_bytes(x, n, i, p["src"]) for i, x in enumerate(xs)]
    raise AssertionError(kind)


def evaluate_group(
    kind: str, axes: tuple[str, ...], group: Sequence[int], xs: Sequence[torch.Tensor], params: dict[str, Any]
) -> list[torch.Tensor]:
    """Run one collective over one group (positions in axis order) and account its bytes."""
    results = _results(kind, xs, params)
    sent = _bytes(kind, xs, params)
    if kind in ("all_gather", "all_to_all") and params.get("size", 0) is None and len(xs) > 1:
        accounting.record_metadata({r: 8 * (len(xs) - 1) for r in group})  # as the real exchange
    accounting.record(kind, axes, xs[0], tuple(group), dict(zip(group, sent)))
    return results


def evaluate_all(
    kind: str, mesh: Mesh, axes: tuple[str, ...], xs: Sequence[torch.Tensor], params: dict[str, Any]
) -> list[torch.Tensor]:
    """List mode: ``xs[r]`` is device r's tensor; returns device r's result at index r."""
    out: list[torch.Tensor | None] = [None] * mesh.size
    for group in mesh.groups(axes):
        for rank, res in zip(group, evaluate_group(kind, axes, group, [xs[r] for r in group], params)):
            out[rank] = res
    return [t for t in out if t is not None]


@dataclass
class _Slot:
    size: int
    calls: dict[int, tuple[str, Params]] = field(default_factory=dict)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    results: list[torch.Tensor] | None = None
    error: BaseException | None = None
    taken: int = 0


class SimulatedWorld:
    """Shared state of one ``run_simulated`` call: rendezvous slots, mailboxes, abort flag."""

    def __init__(self, mesh: Mesh, timeout: float) -> None:
        self.mesh = mesh
        self.timeout = timeout
        self.cond = threading.Condition()
        self.slots: dict[tuple[tuple[int, ...], int], _Slot] = {}
        self.seq: dict[tuple[int, tuple[int, ...]], int] = {}
        self.mail: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self.mail_seq: dict[tuple[int, int, str], int] = {}
        self.failed: tuple[int, BaseException] | None = None

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            if self.failed is not None:
                raise _Aborted(f"aborted: rank {self.failed[0]} failed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShardingError(
                    f"{what} timed out after {self.timeout:.0f} s: a member never "
                    "arrived (rank-dependent control flow around collectives?)"
                )
            self.cond.wait(min(left, 0.5))

    def collective(
        self, rank: int, kind: str, axes: tuple[str, ...], x: torch.Tensor, params: dict[str, Any]
    ) -> torch.Tensor:
        group = tuple(self.mesh.group_of(rank, axes))
        pos = group.index(rank)
        call = (kind, tuple(sorted((k, _freeze(v)) for k, v in params.items())))
        with self.cond:
            n = self.seq.get((rank, group), 0)
            self.seq[(rank, group)] = n + 1
            key = (group, n)
            slot = self.slots.setdefault(key, _Slot(len(group)))
            slot.calls[pos], slot.tensors[pos] = call, x
            if len(slot.tensors) == slot.size:
                try:
                    if len(set(slot.calls.values())) > 1:
                        raise kernels.check_group_error(kind, [slot.calls[i] for i in range(slot.size)])
                    xs = [slot.tensors.pop(i) for i in range(slot.size)]
                    slot.results = evaluate_group(kind, axes, group, xs, params)
                    del xs  # the inputs die with their callers' references, not with the slot
                except BaseException as exc:
                    slot.error = exc
                self.cond.notify_all()
            else:
                self._wait(
                    lambda: slot.results is not None or slot.error is not None,
                    f"{kind} over {axes} (group {list(group)}, call #{n})",
                )
            slot.taken += 1
            if slot.taken == slot.size:
                del self.slots[key]
            if slot.error is not None:
                raise slot.error
            assert slot.results is not None
            return slot.results[pos]

    def send(self, rank: int, dst: int, x: torch.Tensor) -> None:
        with self.cond:
            n = self.mail_seq.get((rank, dst, "send"), 0)
            self.mail_seq[(rank, dst, "send")] = n + 1
            self.mail.setdefault((rank, dst, n), []).append(x.clone())
            self.cond.notify_all()

    def recv(self, rank: int, src: int) -> torch.Tensor:
        with self.cond:
            n = self.mail_seq.get((src, rank, "recv"), 0)
            self.mail_seq[(src, rank, "recv")] = n + 1
            key = (src, rank, n)
            self._wait(lambda: key in self.mail, f"recv on rank {rank} from rank {src} (#{n})")
            return self.mail.pop(key)[0]

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = (rank, exc)
            self.cond.notify_all()


class _Aborted(RuntimeError):
    """Raised in the other ranks when one rank of a simulated run failed."""


_local = threading.local()


def hold(out: torch.Tensor, x: torch.Tensor) -> None:
    """Keep an async collective's input referenced until ``release(out)``: a simulated collective
    completes at its launch, but a real rank holds the input (or, on gloo's reduce-scatter, a copy
    of it) until the wait, so a simulated run holds the bytes a real one does."""
    _local.in_flight[out.untyped_storage().data_ptr()] = x


def release(out: torch.Tensor) -> None:
    """The wait of the async collective whose result is (a view of) ``out``."""
    getattr(_local, "in_flight", {}).pop(out.untyped_storage().data_ptr(), None)


def current() -> tuple[SimulatedWorld, int] | None:
    """The (world, rank) of the calling thread inside ``run_simulated``, else None."""
    world = getattr(_local, "world", None)
    return None if world is None else (world, _local.rank)


def run_simulated(fn: Callable[..., Any], mesh: Mesh, *args: Any, timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, *args)`` once per virtual device of ``mesh``, concurrently; results by rank.

    Inside ``fn`` the collectives take and return this rank's local tensors, exactly as they do in a
    real multi-process run. The first rank to raise aborts the others and its exception is re-raised.
    """
    if not mesh.simulated:
        raise ShardingError(
            f"run_simulated needs a simulated mesh, got {mesh!r}.\nFix: build it with "
            "Mesh(..., simulate=True)."
        )
    world = SimulatedWorld(mesh, timeout)
    results: list[Any] = [None] * mesh.size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        _local.world, _local.rank, _local.in_flight = world, rank, {}
        try:
            results[rank] = fn(rank, *args)
        except BaseException as exc:
            errors[rank] = exc
            world.fail(rank, exc)
        finally:
            _local.world, _local.in_flight = None, {}

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(mesh.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if world.failed is not None:
        raise world.failed[1]
    return results


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(i) for i in v)
    return v
