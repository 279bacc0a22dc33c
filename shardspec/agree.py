"""Cross-rank agreement with a deadline: the primitive behind every "all ranks must match" check.

One all-reduce (MAX of ``v`` and ``-v``) tells every rank at once whether all ranks hold the same small
integer vector; only when they do not does a second collective fetch everyone's vector, so callers
can name the rank groups. Waiting has a deadline, so a rank that never arrives becomes an error
instead of a hang.
"""

from __future__ import annotations

import datetime
import hashlib
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
        raise fail(
            f"{what} did not complete within {timeout:g} s ({exc}). Some rank did not call it, is still "
            "busy with earlier work, or has died.",
            "make every rank of the mesh make the same calls in the same order (no `if rank == 0:` "
            "around a collective call); raise the timeout for slow ranks.",
        ) from None


def comm_device() -> torch.device:
    """Where the default group's collectives take their tensors: NCCL only moves GPU memory."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def disagreeing(values: torch.Tensor, timeout: float, what: str) -> list[torch.Tensor] | None:
    """Every rank's ``values`` (an int64 vector, on the CPU), or None when every rank holds the same."""
    import torch.distributed as dist

    dev = comm_device()
    both = torch.cat([values, -values]).to(dev)
    wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, async_op=True), timeout, what)
    both = both.cpu()
    n = values.numel()
    if torch.equal(both[:n], values) and torch.equal(-both[n:], values):
        return None
    everyone = [torch.zeros_like(values, device=dev) for _ in range(dist.get_world_size())]
    wait(dist.all_gather(everyone, values.to(dev), async_op=True), timeout, what)
    return [v.cpu() for v in everyone]


def groups(everyone: list[torch.Tensor]) -> list[list[int]]:
    """Ranks grouped by equal vectors, in rank order."""
    found: dict[tuple[int, ...], list[int]] = {}
    for r, v in enumerate(everyone):
        found.setdefault(tuple(v.tolist()), []).append(r)
    return list(found.values())
