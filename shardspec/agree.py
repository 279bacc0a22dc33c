"""Cross-rank agreement with a deadline: the primitive behind every "all ranks must match" check.

One all-reduce (MAX of ``v`` and ``-v``) tells every rank at once whether all ranks hold the same small
integer vector (on one host, an exchange of its digest in shared memory); only when they do not does
a second collective fetch everyone's vector, so callers can name the rank groups. Waiting has a
deadline, so a rank that never arrives becomes an error instead of a hang.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Callable
from typing import Any

import torch

from shardspec.errors import fail


def digest(text: str) -> int:
    """A 60-bit hash of ``text`` that fits an int64 and is the same in every process."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def wait(work: Any, timeout: float, what: str) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        from collectives.distributed import mark_broken

        # the check stays posted: a late peer's check, or this rank's next collective, would pair with it
        mark_broken(f"{what} did not complete within {timeout:g} s.")
        raise _not_completed(what, timeout, str(exc)) from None


def _not_completed(what: str, timeout: float, detail: str) -> Exception:
    return fail(
        f"{what} did not complete within {timeout:g} s ({detail}). Some rank did not call it, is still "
        "busy with earlier work, or has died. The check stays posted, so this process group cannot "
        "run another collective.",
        "make every rank of the mesh make the same calls in the same order (no `if rank == 0:` "
        "around a collective call) and start the job again; raise the timeout for slow ranks.",
    )


_CHECK_GROUP: list[Any] = []


def check_group() -> Any:
    """The group agreement checks run on: the default one, or under NCCL a gloo group over the same
    ranks, so that a check moves CPU integers and never waits for the GPU's queued work (a check on
    NCCL would synchronize the device on every call). Created on first use, which every rank reaches
    at the same point (the first check)."""
    import torch.distributed as dist

    if not _CHECK_GROUP or _CHECK_GROUP[0][0] is not dist.group.WORLD:
        group = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
        _CHECK_GROUP[:] = [(dist.group.WORLD, group)]
    return _CHECK_GROUP[0][1]


CHECKPOINT_CALLS = {digest(f"checkpoint.{w}"): f"checkpoint.{w}" for w in ("save", "load")}


def called(word: int) -> str:
    """What a rank called, from the first word of its agreement vector (a checkpoint call's
    name, else a sharded step's identity digest)."""
    return CHECKPOINT_CALLS.get(word, "a sharded step")


def other_calls(everyone: list[torch.Tensor], this: str, same: Callable[[int], bool]) -> None:
    """Raise, naming each rank's call, where some rank's vector (its word 0) is not of ``this``
    kind of call by ``same``: a checkpoint call met a step's check, or a step a checkpoint's."""
    other = {r: called(int(v[0])) for r, v in enumerate(everyone) if not same(int(v[0]))}
    if other:
        raise fail(
            f"{this}: other ranks made another call at this point ("
            + ", ".join(f"rank {r}: {c}" for r, c in other.items())
            + "); the ranks' calls differ. Nothing was run, written or read.",
            "call checkpoint.save and checkpoint.load at the same points on every rank, and every "
            "sharded step alike (no `if rank == 0:` around either).",
        )


def disagreeing(values: torch.Tensor, timeout: float, what: str) -> list[torch.Tensor] | None:
    """Every rank's ``values`` (an int64 vector on the CPU), or None when every rank holds the same."""
    return start_disagreeing(values, timeout, what)()


def start_disagreeing(
    values: torch.Tensor, timeout: float, what: str
) -> Callable[[], list[torch.Tensor] | None]:
    """``disagreeing`` in two halves: the all-reduce is issued now and the returned function waits
    for it (and only on disagreement gathers every rank's vector), so work in between overlaps it.
    Where the ranks share a host (``collectives.same_host``, once the group is probed) the check is
    an exchange of one digest in shared memory instead, complete when this returns."""
    import torch.distributed as dist

    from collectives import same_host

    group = check_group()
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if (h := same_host.probed(pg)) is not None:
        return _on_host(h, values, timeout, what, group)
    both = torch.cat([values, -values])
    work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def finish() -> list[torch.Tensor] | None:
        wait(work, timeout, what)
        n = values.numel()
        if torch.equal(both[:n], values) and torch.equal(-both[n:], values):
            # a gloo mesh's step waits within timeout anyway; an NCCL mesh's waits unbounded
            _probe(pg, timeout if group is None else None, what)
            return None
        return _everyone(values, timeout, what, group)

    return finish


def _probe(pg: Any, timeout: float | None, what: str) -> None:
    """Probe the group for the same-host path once every rank agreed (a collective: every rank is
    here), its waits as the check's own within ``timeout`` (None: unbounded): a peer whose check
    this one paired with may have timed out before the pairing and never reach the probe."""
    from collectives import same_host

    finish = None if timeout is None else (lambda work: wait(work, timeout, what))
    same_host.host(pg, torch.device("cpu"), finish)


def _on_host(
    h: Any, values: torch.Tensor, timeout: float, what: str, group: Any
) -> Callable[[], list[torch.Tensor] | None]:
    """The check through the host's control block: every rank's digest of its vector; only when
    they differ (on every rank alike) the vectors themselves, over gloo, to name the groups."""
    from collectives.distributed import mark_broken

    try:
        digests = h.exchange(digest(repr(values.tolist())), timeout)
    except TimeoutError:
        mark_broken(f"{what} did not complete within {timeout:g} s.")
        raise _not_completed(what, timeout, "a peer did not reach it") from None
    if digests is None:
        mark_broken(f"{what} met another collective of a peer.")
        raise fail(
            f"{what} met another collective on some rank: the ranks' calls differ (one rank makes "
            "a step or checkpoint call where another calls a collective of its own). This process "
            "group cannot run another collective.",
            "make every rank of the mesh make the same calls in the same order (no `if rank == 0:` "
            "around a collective call) and start the job again.",
        )
    if len(set(digests)) == 1:
        return lambda: None
    everyone = _everyone(values, timeout, what, group)
    return lambda: everyone


def _everyone(values: torch.Tensor, timeout: float, what: str, group: Any) -> list[torch.Tensor]:
    import torch.distributed as dist

    everyone = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
    wait(dist.all_gather(everyone, values, group=group, async_op=True), timeout, what)
    return everyone


def groups(everyone: list[torch.Tensor]) -> list[list[int]]:
    """Ranks grouped by equal vectors, in rank order."""
    found: dict[tuple[int, ...], list[int]] = {}
    for r, v in enumerate(everyone):
        found.setdefault(tuple(v.tolist()), []).append(r)
    return list(found.values())
