"""What one rank measures: collective launches and bytes, peak memory of a step, and step times with
the two sides alternated in the same process.

Torch-side collectives are counted with a TorchDispatchMode: DDP's reducer, FSDP2 and DTensor all
reach c10d through dispatcher ops (``c10d::allreduce_``, ``c10d::_allgather_base_``,
``_c10d_functional::all_reduce``, ...), also from inside backward, which wrapping the Python
``torch.distributed`` functions would miss (DDP calls the process group from C++). Ops nested inside
a counted op run with the mode off, so a functional collective is not counted again as the c10d op
that implements it.

Peak memory is the peak resident set size during one step minus the resident size before it, read
from Linux's VmHWM after resetting it (``/proc/self/clear_refs``), with ``malloc_trim`` first so
pages freed by earlier steps are given back and a step's allocations show up as new resident pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks._compare_sides import Side, make_batch, shardspec_side, torch_side

# c10d op name -> (kind, which argument holds S, the full tensor's bytes)
_C10D: dict[str, tuple[str, str]] = {
    "allreduce_": ("all_reduce", "first"),
    "allreduce_coalesced_": ("all_reduce", "first"),
    "_allgather_base_": ("all_gather", "first"),  # (output, input): S = output
    "allgather_": ("all_gather", "first"),
    "allgather_into_tensor_coalesced_": ("all_gather", "first"),
    "_reduce_scatter_base_": ("reduce_scatter", "second"),  # (output, input): S = input
    "reduce_scatter_": ("reduce_scatter", "second"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
    "alltoall_base_": ("all_to_all", "second"),
    "broadcast_": ("broadcast", "first"),
}
_FUNCTIONAL: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.numel() * x.element_size())
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def ring_bytes(kind: str, full_bytes: float, n: int) -> float:
    """Bytes one rank sends (ring algorithms, phi = (n-1)/n): all_reduce 2·phi·S, all_gather /
    reduce_scatter / all_to_all phi·S, broadcast S; S is the full tensor's bytes."""
    phi = (n - 1) / n
    return {"all_reduce": 2 * phi * full_bytes, "broadcast": float(full_bytes)}.get(kind, phi * full_bytes)


def _group_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.ScriptObject):
            try:
                return int(dist.ProcessGroup.unbox(a).size())
            except Exception:
                break
        if isinstance(a, str):
            try:
                resolve = getattr(dist.distributed_c10d, "_resolve_process_group")  # noqa: B009
                return int(resolve(a).size())
            except Exception:
                continue
    return dist.get_world_size()


class CommCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts collective launches and the bytes each rank sends, by kind."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.launches: dict[str, int] = {}
        self.bytes: dict[str, float] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        kind, full = None, 0.0
        if func.namespace == "c10d" and name in _C10D:
            kind, which = _C10D[name]
            full = _tensor_bytes(args[0] if which == "first" else args[1])
        elif func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            full = _tensor_bytes(args[0])
            if kind == "all_gather":  # the input is this rank's block: S = n blocks
                full *= _group_size(args, kwargs)
        if kind is not None:
            n = _group_size(args, kwargs)
            self.launches[kind] = self.launches.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0.0) + ring_bytes(kind, full, n)
        return func(*args, **kwargs)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss_delta(fn: Callable[[], Any]) -> int | None:
    """Bytes the resident set grew to above its size before ``fn`` (None where VmHWM cannot be reset)."""
    gc.collect()
    _malloc_trim()
    before = _rss_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    fn()
    return max(0, _rss_kib("VmHWM") - before) * 1024


def _timed(step: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t0


def measure(
    strategy: str,
    cfg: Any,
    world: int,
    batch_size: int,
    rounds: int,
    steps: int,
    warmup: int,
    backend: str = "eager",
) -> dict[str, Any]:
    """Both sides of one strategy on this rank: first losses, probes, then alternated timing."""
    import collectives

    batch = make_batch(cfg, batch_size)
    sides: dict[str, Side] = {
        "shardspec": shardspec_side(strategy, cfg, world, batch, backend),
        "torch": torch_side(strategy, cfg, world, batch),
    }
    out: dict[str, Any] = {"strategy": strategy, "world": world, "rank": dist.get_rank()}
    out["compile_s"] = sides["shardspec"].info["compile_s"]
    t0 = time.perf_counter()
    first = sides["shardspec"].step()  # backend="inductor" compiles the per-rank program here
    out["first_call_s"] = time.perf_counter() - t0
    ss_side = sides["shardspec"]
    out["loss"] = {
        "shardspec": [ss_side.global_loss(first), ss_side.global_loss(ss_side.step())],
        "torch": [sides["torch"].global_loss(sides["torch"].step()) for _ in range(2)],
    }
    for _ in range(warmup):
        for s in sides.values():
            s.step()
    # one probe step per side, after warmup (DDP rebuilds its buckets on its second step)
    ss = sides["shardspec"]
    with collectives.count_bytes() as sent:
        ss_peak = peak_rss_delta(ss.step)
    counter = CommCounter()

    def counted() -> None:
        with counter:
            sides["torch"].step()

    torch_peak = peak_rss_delta(counted)
    observed_kinds: dict[str, int] = {}
    for rec in sent.records:
        observed_kinds[rec.kind] = observed_kinds.get(rec.kind, 0) + 1
    out["comm"] = {
        "shardspec": {
            "launches": ss.info["launches"],
            "bytes": ss.info["bytes"],
            "launches_by_kind": ss.info["launches_by_kind"],
            "observed_launches": sent.count,
            "observed_launches_by_kind": observed_kinds,
            "observed_bytes": sent.total_bytes_per_rank,
        },
        "torch": {
            "launches": sum(counter.launches.values()),
            "bytes": sum(counter.bytes.values()),
            "launches_by_kind": counter.launches,
        },
    }
    out["memory"] = {
        "shardspec": {
            "step_peak_delta": ss_peak,
            "state_bytes": ss.state_bytes(),
            "planned_peak": ss.info["planned_peak_bytes"],
        },
        "torch": {"step_peak_delta": torch_peak, "state_bytes": sides["torch"].state_bytes()},
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds):
        order = ["shardspec", "torch"] if r % 2 == 0 else ["torch", "shardspec"]  # A B B A ...
        for name in order:
            for _ in range(steps):
                times[name].append(_timed(sides[name].step))
    out["times"] = times
    return out


def worker(
    rank: int, world: int, cfg: Any, strategies: list[str], opts: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every strategy for one world size, in the same processes (run_distributed target)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    results = []
    for strategy in strategies if world > 1 else ["single"]:
        results.append(measure(strategy, cfg, world, **opts))
        gc.collect()
    return results


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One strategy's row: per step the slowest rank's time; ratios shardspec / torch."""
    first = per_rank[0]
    steps = {
        side: [max(r["times"][side][i] for r in per_rank) for i in range(len(first["times"][side]))]
        for side in ("shardspec", "torch")
    }
    med = {k: statistics.median(v) for k, v in steps.items()}
    low = {k: min(v) for k, v in steps.items()}

    def peak(side: str, key: str) -> int | None:
        vals = [r["memory"][side][key] for r in per_rank]
        return None if any(v is None for v in vals) else max(vals)

    return {
        "world": first["world"],
        "strategy": first["strategy"],
        "median_s": med,
        "min_s": low,
        "ratio_median": med["shardspec"] / med["torch"],
        "ratio_min": low["shardspec"] / low["torch"],
        "comm": first["comm"],
        "memory": {
            side: {
                "step_peak_delta": peak(side, "step_peak_delta"),
                "state_bytes": peak(side, "state_bytes"),
            }
            for side in ("shardspec", "torch")
        }
        | {"shardspec_planned_peak": first["memory"]["shardspec"]["planned_peak"]},
        "loss": first["loss"],
        "compile_s": max(r["compile_s"] for r in per_rank),
        "first_call_s": max(r["first_call_s"] for r in per_rank),
        "steps_timed": len(steps["shardspec"]),
    }
