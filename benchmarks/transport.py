"""One collective at a time, through the same-host transport and through gloo, alternated.

``python -m benchmarks.transport --world 2 --sizes 4096,1048576,13293580 --rounds 30`` runs, on gloo
processes of this host, shardspec's ``all_reduce`` (in place), ``reduce_scatter`` and ``all_gather``
of each size (bytes of the full tensor), switching the same-host path on and off between calls
(A B, then B A, ...), and prints the median and minimum milliseconds of each (the slowest rank's).
The bytes sent are the ring formulas' either way; only the transport differs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardspec.testing import run_distributed


def worker(rank: int, world: int, sizes: list[int], rounds: int) -> dict[str, list[float]]:
    import collectives.distributed as cd
    from collectives import same_host
    from shardspec import Mesh

    mesh = Mesh({"x": world})
    probe = torch.ones(world)
    cd.all_reduce_inplace(mesh, ("x",), probe, "sum", False)  # the group's probe, once
    ways = {"same-host": same_host.host, "gloo": lambda pg, device: None}
    out: dict[str, list[float]] = {}
    for nbytes in sizes:
        for kind, call in _calls(cd, mesh, world, nbytes).items():
            for k in range(2 * rounds + 2):
                way = list(ways)[(k + k // 2) % 2]  # A B B A A B ...
                same_host.host = ways[way]
                dist.barrier()
                start = time.perf_counter()
                call()
                elapsed = time.perf_counter() - start
                if k >= 2:  # the first of each way warms up
                    out.setdefault(f"{kind} {nbytes} {way}", []).append(elapsed * 1e3)
        same_host.host = ways["same-host"]
    return out


def _calls(cd: Any, mesh: Any, world: int, nbytes: int) -> dict[str, Callable[[], Any]]:
    x = torch.randn(max(world, nbytes // 4 // world * world))
    shard = torch.empty(x.numel() // world)
    return {
        "all_reduce": lambda: cd.all_reduce_inplace(mesh, ("x",), x, "sum", False),
        "reduce_scatter": lambda: cd.reduce_scatter(mesh, ("x",), x, 0, "sum", False),
        "all_gather": lambda: cd.all_gather(mesh, ("x",), shard, 0, shard.numel() * world, False),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", default="4096,1048576,4194304,13293580", help="bytes, comma-separated")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    per_rank = run_distributed(worker, args.world, args=(sizes, args.rounds), timeout=600)
    print(f"world {args.world}, {args.rounds} calls per way; ms, the slowest rank per call")
    print("| collective | bytes | same-host med / min | gloo med / min | ratio med |")
    print("|---|---|---|---|---|")
    for key in per_rank[0]:
        kind, nbytes, way = key.split()
        if way != "same-host":
            continue
        ours = [max(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key]))]
        theirs_key = f"{kind} {nbytes} gloo"
        theirs = [max(r[theirs_key][i] for r in per_rank) for i in range(len(per_rank[0][theirs_key]))]
        a, b = statistics.median(ours), statistics.median(theirs)
        print(
            f"| {kind} | {nbytes} | {a:.2f} / {min(ours):.2f} | {b:.2f} / {min(theirs):.2f} | {a / b:.2f} |"
        )


if __name__ == "__main__":
    main()
