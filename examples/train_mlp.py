"""Train the example MLP with @sharded under a strategy chosen by specs, and show the plan.

python -m examples.train_mlp                 # ZeRO-3 on a simulated 4-device mesh
python -m examples.train_mlp --strategy dp
torchrun --nproc-per-node=4 -m examples.train_mlp --real   # 4 processes (gloo, or NCCL on GPUs)
"""

from __future__ import annotations

import argparse

import torch

from examples.models import mlp
from shardspec import Mesh, P, optim, sharded

STRATEGIES = {
    "dp": ({"w1": P(), "b1": P(), "w2": P()}, P("dp")),
    "zero3": ({"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}, P("dp")),
    "megatron": ({"w1": P(None, "dp"), "b1": P("dp"), "w2": P("dp", None)}, P()),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=sorted(STRATEGIES), default="zero3")
    ap.add_argument("--real", action="store_true", help="run under torchrun instead of simulating")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    mesh = Mesh({"dp": 4}, simulate=not args.real)
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    pspec, bspec = STRATEGIES[args.strategy]
    sspec = opt.state_specs(pspec)
    step = sharded(
        mlp.make_step(opt), mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P())
    )

    params = mlp.init(8, 16, 4)
    state = opt.init(params)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    low = step.lower(params, state, x, y)
    if not args.real or mesh.rank == 0:
        print(low.explain())
        print()
    for i in range(args.steps):
        params, state, loss = step(params, state, x, y)
        value = loss.full_tensor() if args.real else loss
        if not args.real or mesh.rank == 0:
            print(f"step {i}: loss {value.item():.4f}")


if __name__ == "__main__":
    main()
