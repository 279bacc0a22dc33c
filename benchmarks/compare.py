"""shardspec against the torch-native equivalent on the example GPT with AdamW, on gloo.

    python -m benchmarks.compare                          # world 1, 2, 4; dp, zero3, tp
    python -m benchmarks.compare --world 2 --rounds 6 --json out.json

Per world size one set of processes runs every strategy; per strategy both sides are built in the
same processes and alternated A B B A ... over ``--rounds`` rounds of ``--steps`` timed steps each
(after ``--warmup`` untimed steps), so machine load drifts over both alike:

- world 1 (``single``): ``@sharded`` on a 1-device mesh vs the eager ``nn.Module`` + torch.optim.AdamW
- ``dp``: params P(), batch P("dp") vs DistributedDataParallel
- ``zero3``: params and AdamW state P("dp") (dim 0, where it divides) vs FSDP2 ``fully_shard``
- ``tp``: Megatron column/row specs vs DTensor ``parallelize_module`` (Colwise/RowwiseParallel)

The first loss of both sides must agree (same init, same batch), or the run fails. See
docs/benchmarks.md for the counting methods and the recorded numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from benchmarks._compare_measure import summarize, worker
from benchmarks._compare_sides import STRATEGIES
from examples.models import gpt
from shardspec.testing import run_distributed

LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5


def run(
    cfg: gpt.Config,
    worlds: list[int],
    strategies: list[str],
    batch: int,
    rounds: int,
    steps: int,
    warmup: int,
    timeout: float = 3600.0,
    backend: str = "eager",
) -> list[dict[str, Any]]:
    """Every (world, strategy) row, summarized; raises if a pair of first losses disagrees."""
    rows = []
    opts = {"batch_size": batch, "rounds": rounds, "steps": steps, "warmup": warmup, "backend": backend}
    for world in worlds:
        if any(s in ("dp", "zero3") for s in strategies) and batch % world:
            raise SystemExit(f"--batch {batch} does not divide world {world}")
        if "tp" in strategies and world > 1 and cfg.heads % world:
            raise SystemExit(f"--heads {cfg.heads} does not split over tp={world}")
        per_rank = run_distributed(worker, world, args=(cfg, strategies, opts), timeout=timeout)
        for i in range(len(per_rank[0])):
            row = summarize([r[i] for r in per_rank])
            ss, tt = row["loss"]["shardspec"][0], row["loss"]["torch"][0]
            if not torch.allclose(torch.tensor(ss), torch.tensor(tt), rtol=LOSS_RTOL, atol=LOSS_ATOL):
                raise AssertionError(
                    f"world {world} {row['strategy']}: first losses differ: shardspec {ss} torch {tt}"
                )
            rows.append(row)
    return rows


def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per (world, strategy)."""
    head = (
        "| world | strategy | shardspec ms med / min | torch ms med / min | ratio med | ratio min "
        "| launches ss / torch | MB sent ss / torch | step peak ΔRSS MB ss / torch "
        "| state MB ss / torch | first loss |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        med, low, comm, mem = r["median_s"], r["min_s"], r["comm"], r["memory"]
        lines.append(
            f"| {r['world']} | {r['strategy']} "
            f"| {med['shardspec'] * 1e3:.0f} / {low['shardspec'] * 1e3:.0f} "
            f"| {med['torch'] * 1e3:.0f} / {low['torch'] * 1e3:.0f} "
            f"| {r['ratio_median']:.2f} | {r['ratio_min']:.2f} "
            f"| {comm['shardspec']['launches']} / {comm['torch']['launches']} "
            f"| {_mb(comm['shardspec']['bytes'])} / {_mb(comm['torch']['bytes'])} "
            f"| {_mb(mem['shardspec']['step_peak_delta'])} / {_mb(mem['torch']['step_peak_delta'])} "
            f"| {_mb(mem['shardspec']['state_bytes'])} / {_mb(mem['torch']['state_bytes'])} "
            f"| {r['loss']['shardspec'][0]:.5f} |"
        )
    return "\n".join(lines)


def kinds(rows: list[dict[str, Any]]) -> str:
    """Launches by kind, per side. For shardspec the planned collectives (one per tensor) and the
    launches that ran (fewer where the compiler buckets several tensors into one call)."""
    out = []
    for r in rows:
        c = r["comm"]
        out.append(
            f"world {r['world']} {r['strategy']}: shardspec launched "
            f"{c['shardspec']['observed_launches_by_kind']} for the planned collectives "
            f"{c['shardspec']['launches_by_kind']}; torch {c['torch']['launches_by_kind']}; "
            f"shardspec compile {r['compile_s']:.1f} s, first call {r['first_call_s']:.1f} s"
        )
    return "\n".join(out)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="1,2,4", help="comma-separated world sizes")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="subset of dp,zero3,tp")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=None, help="default: 2 x the largest world")
    ap.add_argument("--rounds", type=int, default=4, help="alternation rounds (A B, then B A, ...)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side after the loss check")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per world size")
    ap.add_argument("--json", default=None, help="write the rows (and the setup) here")
    ap.add_argument(
        "--backend", default="eager", choices=("eager", "inductor"), help="shardspec's sharded(backend=)"
    )
    a = ap.parse_args(argv)
    worlds = _ints(a.world)
    strategies = [s for s in a.strategies.split(",") if s]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown or not strategies:
        ap.error(f"--strategies takes a subset of {','.join(STRATEGIES)}, got {a.strategies!r}")
    cfg = gpt.Config(vocab=a.vocab, seq=a.seq, d=a.d, heads=a.heads, layers=a.layers)
    batch = a.batch if a.batch is not None else 2 * max(worlds)
    cores = os.cpu_count() or 1
    print(
        f"GPT layers={cfg.layers} d={cfg.d} heads={cfg.heads} seq={cfg.seq} vocab={cfg.vocab} "
        f"batch={batch}; AdamW; gloo; torch {torch.__version__}; {cores} CPU cores; "
        f"{a.rounds} rounds x {a.steps} steps per side, {a.warmup} warmup; shardspec backend {a.backend}",
        flush=True,
    )
    for w in worlds:
        if w > cores:
            print(
                f"note: world {w} runs {w} processes on {cores} cores (oversubscribed): its times "
                "include waiting for a core"
            )
    rows = run(cfg, worlds, strategies, batch, a.rounds, a.steps, a.warmup, a.timeout, a.backend)
    print(table(rows))
    print(kinds(rows))
    if a.json:
        setup = {**vars(a), "batch": batch, "cores": cores, "torch": torch.__version__}
        with open(a.json, "w") as f:
            json.dump({"setup": setup, "rows": rows}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
