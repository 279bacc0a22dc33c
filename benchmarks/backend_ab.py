"""shardspec's eager backend against ``backend="inductor"`` on the example GPT, in the same processes.

    python -m benchmarks.backend_ab --world 2 --strategy dp --rounds 8

Both steps are built from the same specs (``benchmarks._compare_sides.shardspec_side``, donated
parameters and AdamW state, the batch pre-placed), compiled and warmed up, then timed alternately
A B, B A, ... (``--steps`` steps per side per round), so load that drifts during the run falls on
both. Prints, per backend, the wall time per step (median and minimum over steps of the slowest
rank), the CPU time this process spent per step (median over ranks and steps: less sensitive to
other jobs on the machine than wall time) and the first call's time (Inductor compiles there).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import torch.distributed as dist

from benchmarks._compare_sides import make_batch, shardspec_side
from examples.models import gpt
from shardspec.testing import run_distributed

BACKENDS = ("eager", "inductor")


def worker(
    rank: int, world: int, cfg: gpt.Config, strategy: str, batch: int, rounds: int, steps: int
) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    sides = {b: shardspec_side(strategy, cfg, world, make_batch(cfg, batch), b) for b in BACKENDS}
    first = {}
    for b, side in sides.items():
        t0 = time.perf_counter()
        side.step()
        first[b] = time.perf_counter() - t0
        side.step()
        side.step()
    wall: dict[str, list[float]] = {b: [] for b in BACKENDS}
    cpu: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for r in range(rounds):
        for b in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            for _ in range(steps):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                sides[b].step()
                c1 = time.process_time()
                dist.barrier()
                wall[b].append(time.perf_counter() - t0)
                cpu[b].append(c1 - c0)
    return {"first": first, "wall": wall, "cpu": cpu}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--strategy", default="dp", help="single (world 1), dp, zero3 or tp")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    cfg = gpt.Config(vocab=256, seq=128, d=a.d, heads=4, layers=a.layers)
    res = run_distributed(worker, a.world, args=(cfg, a.strategy, a.batch, a.rounds, a.steps), timeout=3600)
    n = len(res[0]["wall"]["eager"])
    wall = {b: [max(r["wall"][b][i] for r in res) for i in range(n)] for b in BACKENDS}
    med = {b: statistics.median(wall[b]) for b in BACKENDS}
    low = {b: min(wall[b]) for b in BACKENDS}
    cpu = {b: statistics.median([c for r in res for c in r["cpu"][b]]) for b in BACKENDS}
    first = {b: max(r["first"][b] for r in res) for b in BACKENDS}
    for b in BACKENDS:
        print(
            f"world {a.world} {a.strategy} {b}: wall ms med {med[b] * 1e3:.0f} min {low[b] * 1e3:.0f}, "
            f"cpu ms med {cpu[b] * 1e3:.0f}, first call {first[b]:.1f} s"
        )
    print(
        f"inductor / eager: wall med {med['inductor'] / med['eager']:.2f}, "
        f"min {low['inductor'] / low['eager']:.2f}, cpu med {cpu['inductor'] / cpu['eager']:.2f}"
    )


if __name__ == "__main__":
    main()
