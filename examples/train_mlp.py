"""Train the example MLP with @sharded under a strategy chosen by specs, and show the plan.

python -m examples.train_mlp                              # ZeRO-3 on a simulated mesh dp=4
python -m examples.train_mlp --strategy dp
python -m examples.train_mlp --strategy megatron          # tensor parallel, mesh dp=2,tp=2
torchrun --nproc-per-node=4 -m examples.train_mlp         # 4 real processes (gloo, or NCCL on GPUs)

The batch is split over ``dp`` (when the mesh has it); ``megatron`` splits the hidden units over
``tp``: the first layer's output columns and the second layer's input rows, so the second matmul
leaves a partial sum that is all-reduced once.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python examples/train_mlp.py` as well as `python -m examples.train_mlp`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Any

import torch

from examples import _cli
from examples.models import mlp
from shardspec import P, optim, sharded

STRATEGIES: dict[str, dict[str, P]] = {
    "dp": {"w1": P(), "b1": P(), "w2": P()},
    "zero3": {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")},
    "megatron": {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)},
}
NEEDS = {"dp": "dp", "zero3": "dp", "megatron": "tp"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = _cli.parser(__doc__, "dp=4")
    ap.set_defaults(mesh=None)
    ap.add_argument("--strategy", choices=sorted(STRATEGIES), default="zero3")
    ap.add_argument("--steps", type=_cli.positive, default=3)
    args = ap.parse_args(argv)  # unknown flags are an error
    if args.mesh is None:
        args.mesh = {"dp": 2, "tp": 2} if args.strategy == "megatron" else {"dp": 4}
    if NEEDS[args.strategy] not in args.mesh:
        axis = NEEDS[args.strategy]
        ap.error(f"--strategy {args.strategy} splits over a {axis!r} mesh axis; --mesh has none")

    mesh = _cli.make_mesh(args)
    say = _cli.say_fn(mesh)
    say(_cli.mode_line(mesh))
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    pspec = STRATEGIES[args.strategy]
    bspec = P("dp") if "dp" in args.mesh else P()
    sspec = opt.state_specs(pspec)
    step = sharded(
        mlp.make_step(opt), mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P())
    )

    params = mlp.init(8, 16, 4)
    state = opt.init(params)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    say(step.lower(params, state, x, y).explain())
    say()
    losses = []
    for i in range(args.steps):
        params, state, loss = step(params, state, x, y)
        losses.append(_cli.full(loss).item())
        say(f"step {i + 1}/{args.steps}: loss {losses[-1]:.4f}")
    return {"losses": losses, "params": {k: _cli.full(v) for k, v in params.items()}}


if __name__ == "__main__":
    _cli.run(main)
