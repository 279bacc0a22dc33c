"""Resident memory of a training step against DDP and FSDP2 on gloo: one side per set of fresh
processes, so neither side's allocations or caches are counted in the other's.

Each rank measures, from Linux's ``/proc/self/status`` (``malloc_trim`` and a garbage collection
before each reading, so pages freed earlier are given back):

- ``base``: resident size before the model exists, after the process group, the batch and a run of
  both sides on a tiny model (so both have every module either side imports loaded);
- ``held``: resident size between steps, after warm-up steps, above ``base``: parameters, optimizer
  state and whatever the side keeps between steps (DDP's persistent gradient buckets and ``.grad``
  tensors, our compiled programs and caches);
- ``step``: the growth of the peak resident size (VmHWM, reset first) during one more step;
- ``peak``: ``held + step``, the most the side has resident above ``base`` while stepping;
- ``process``: the process's peak resident size since it started (compilation included).

The step is the GPT of ``benchmarks/memory_table.py`` with fp32 AdamW: ours ``@sharded`` with
``donate=(0, 1)`` (parameters replicated for DP, split over dp for ZeRO-3), torch's the ``nn.Module``
with ``torch.optim.AdamW`` under ``DistributedDataParallel`` or FSDP2 ``fully_shard`` per block and
root (``benchmarks/_compare_sides.py``).
"""

from __future__ import annotations

import gc
from typing import Any, cast

import optree
import torch

from benchmarks._compare_measure import _malloc_trim, _rss_kib, peak_rss_delta
from benchmarks._compare_sides import held_bytes, make_batch, torch_side
from examples.models import gpt

SIDES = {"dp": "DDP", "zero3": "FSDP2"}


def _resident() -> int:
    gc.collect()
    _malloc_trim()
    return _rss_kib("VmRSS") * 1024


def _ours(strategy: str, cfg: gpt.Config, world: int, batch: tuple[torch.Tensor, ...]) -> Any:
    """Our donated fp32 step; returns (step, state bytes, predicted peak)."""

    from benchmarks.memory_schedule import _step
    from benchmarks.memory_table import OPT
    from shardspec import Mesh, P, from_local, sharded

    mesh = Mesh({"dp": world})
    rank = torch.distributed.get_rank()
    params = gpt.init(cfg)
    pspec = {k: (P("dp") if strategy == "zero3" else P()) for k in params}
    f = sharded(
        _step(cfg, OPT, remat=False),
        mesh=mesh,
        in_specs=(pspec, OPT.state_specs(pspec), P("dp"), P("dp")),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
        donate=(0, 1),
    )
    tok, tgt = (from_local(t.chunk(world)[rank].contiguous(), P("dp"), mesh) for t in batch)
    live: list[Any] = [params, OPT.init(params)]
    predicted = f.lower(live[0], live[1], tok, tgt).cost().peak_memory_bytes_per_rank

    def step() -> None:
        live[0], live[1], _ = f(live[0], live[1], tok, tgt)

    def state() -> int:
        leaves: list[Any] = optree.tree_leaves(cast(Any, live), none_is_leaf=False)
        return held_bytes(leaves)

    return step, state, predicted


def _load_both_sides(strategy: str, world: int) -> None:
    """Both sides run once on a tiny model and are dropped, so the modules either side imports
    (DTensor, DDP, FSDP2, our tracer) are loaded in every process before ``base`` is read: library
    code is a fixed cost, not the step's memory."""
    tiny = gpt.Config(vocab=16, seq=4, d=16, heads=2, layers=1)
    batch = make_batch(tiny, 2 * world)
    ours = _ours(strategy, tiny, world, batch)[0]
    theirs = torch_side(strategy, tiny, world, batch).step
    for _ in range(2):
        ours()
        theirs()


def side_rss(rank: int, world: int, side: str, strategy: str, cfg: gpt.Config, rows: int) -> dict[str, Any]:
    """One side (``"ours"`` or ``"torch"``) of one strategy in this fresh process (run_distributed)."""
    import warnings

    warnings.filterwarnings("ignore")
    _load_both_sides(strategy, world)
    batch = make_batch(cfg, rows * world)
    base = _resident()
    predicted = 0
    if side == "ours":
        step, state, predicted = _ours(strategy, cfg, world, batch)
    else:
        s = torch_side(strategy, cfg, world, batch)
        step, state = s.step, s.state_bytes
    for _ in range(3):  # warm-up (ours compiles here; DDP builds its buckets by its second step)
        step()
    held = _resident() - base
    process_before = _rss_kib("VmHWM") * 1024
    grown = peak_rss_delta(step) or 0
    process = max(process_before, _rss_kib("VmHWM") * 1024)
    return {
        "state": state(),
        "held": held,
        "step": grown,
        "peak": held + grown,
        "process": process,
        "base": base,
        "predicted": predicted,
    }


def versus_torch(world: int, cfg: gpt.Config, rows: int, rounds: int = 2) -> dict[str, dict[str, Any]]:
    """Both sides of DP and ZeRO-3, each in its own fresh processes, alternated (ours, torch, torch,
    ours, ...); per side and figure the largest over rounds of the largest over ranks."""
    from shardspec.testing import run_distributed

    out: dict[str, dict[str, Any]] = {}
    for strategy in SIDES:
        runs: dict[str, list[list[dict[str, Any]]]] = {"ours": [], "torch": []}
        for r in range(rounds):
            for side in ("ours", "torch") if r % 2 == 0 else ("torch", "ours"):
                runs[side].append(
                    run_distributed(
                        side_rss, world, args=(side, strategy, cfg, rows), timeout=900, start_method="spawn"
                    )
                )
        out[strategy] = {
            side: {
                key: max(per_rank[i][key] for per_rank in per_run for i in range(world))
                for key in per_run[0][0]
            }
            | {"runs": [[p["peak"] for p in per_rank] for per_rank in per_run]}
            for side, per_run in runs.items()
        }
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def render(per_world: dict[int, dict[str, dict[str, Any]]], load: str, model: str = "") -> list[str]:
    lines = [
        f"## Against DDP and FSDP2 (fp32 AdamW, gloo){': ' + model if model else ''}",
        "",
        "Resident memory, each side in its own freshly started (spawned) processes"
        " (`benchmarks/memory_rss.py`):"
        " `held` is the resident size between steps above the size before the model existed"
        " (parameters, optimizer state and what the side keeps: DDP's persistent gradient buckets and"
        " `.grad` tensors, our compiled programs and caches), `step` the growth of the peak resident"
        " size during one step after warm-up, `peak` = held + step, `process` the process's peak"
        " resident size since it started (our compilation included). `state` is the bytes of"
        " parameters and optimizer state alone. Ours: `donate=(0, 1)`, parameters replicated (DP) or"
        " split over dp (ZeRO-3); torch: `torch.optim.AdamW` under `DistributedDataParallel` or FSDP2"
        " `fully_shard` per block and root. The largest over ranks and over two runs per side,"
        f" alternated (load average {load}).",
        "",
        "| world | ours | state | held | step | peak | process | predicted | torch | state | held | step |"
        " peak | process | peak at most torch's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, cmp in sorted(per_world.items()):
        for strategy, name in SIDES.items():
            o, t = cmp[strategy]["ours"], cmp[strategy]["torch"]
            cells = [_mib(o[k]) for k in ("state", "held", "step", "peak", "process", "predicted")]
            theirs = [_mib(t[k]) for k in ("state", "held", "step", "peak", "process")]
            verdict = "yes" if o["peak"] <= t["peak"] else "no"
            lines.append(
                f"| {world} | {strategy} | {' | '.join(cells)} | {name} | {' | '.join(theirs)} | {verdict} |"
            )
    lines += [
        "",
        "MiB per rank. `predicted` is our `cost().peak_memory_bytes_per_rank` (live tensors, inputs"
        " included): `held + step` above it is what the process holds besides the program's tensors"
        " (compiled programs, caches, the allocator's free lists). Resident sizes are the allocator's"
        " view: blocks the C library keeps after a free count until trimmed, and both sides run under"
        " the same allocator.",
    ]
    return lines
