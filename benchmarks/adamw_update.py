"""The AdamW update alone, on the example GPT's parameters (one process, one thread):

    python -m benchmarks.adamw_update --rounds 15

Alternates, per round, one update each of: torch.optim.AdamW with its defaults (on CPU the
per-parameter single-tensor loop), torch.optim.AdamW(fused=True), our donated update
(``shardspec::adamw_multi_``: the fused kernel in place, one call for all parameters) and our
undonated one (one functional ``shardspec::adamw`` per parameter, fresh results). Prints the median
and minimum of each in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from examples.models import gpt
from shardspec import optim

LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-6, 0.01  # benchmarks.compare's


def _torch_step(params: list[torch.Tensor], grads: list[torch.Tensor], fused: bool) -> Callable[[], None]:
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(leaves, grads, strict=True):
        p.grad = g
    opt = torch.optim.AdamW(
        leaves, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY, fused=True if fused else None
    )
    opt.step()  # the state exists from here on
    return lambda: opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = gpt.Config(vocab=256, seq=128, d=256, heads=4, layers=4)
    gen = torch.Generator().manual_seed(0)
    params = list(gpt.init(cfg).values())
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    moments = [[torch.rand(p.shape, generator=gen) * 1e-3 for p in params] for _ in range(2)]
    step = torch.tensor(3.0)
    hyper = (LR, BETA1, BETA2, EPS, WEIGHT_DECAY)
    state = [[t.clone() for t in ts] for ts in (params, *moments)]

    def ours_donated() -> None:
        optim.adamw_multi_inplace_kernel(state[0], grads, state[1], state[2], step, *hyper)

    def ours_functional() -> None:
        for p, g, m, v in zip(params, grads, *moments, strict=True):
            torch.ops.shardspec.adamw(p, g, m, v, step, *hyper)

    sides = {
        "torch.optim.AdamW (default: per-parameter loop)": _torch_step(params, grads, fused=False),
        "torch.optim.AdamW(fused=True)": _torch_step(params, grads, fused=True),
        "shardspec, donated (adamw_multi_, in place)": ours_donated,
        "shardspec, not donated (adamw per parameter)": ours_functional,
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
    size = sum(p.numel() for p in params) / 1e6
    print(f"{size:.1f} M parameters in {len(params)} tensors, {args.rounds} rounds")
    for name, ts in times.items():
        print(f"{name:48s} median {statistics.median(ts) * 1e3:7.2f} ms   min {min(ts) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
