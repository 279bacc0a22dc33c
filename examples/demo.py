"""shardspec in one run: a small GPT trained data- and tensor-parallel on a simulated 8-device mesh.

python examples/demo.py                      # dp=2 x tp=4, simulated
python examples/demo.py --mesh dp=4,tp=2 --steps 5
torchrun --nproc-per-node 8 examples/demo.py   # the same on 8 real processes

It prints the mesh, where each parameter lives, every collective the compiler inserted grouped by
the model line that needs it, one line per training step, and finally checks the sharded result
against the same steps run unsharded in plain PyTorch.
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):  # `python examples/demo.py` as well as `python -m examples.demo`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from examples import _cli
from examples.models import gpt
from examples.train_gpt import OPT, batch, make_step, strategy_specs
from shardspec import P, sharded


def main(argv: list[str] | None = None) -> None:
    ap = _cli.parser(__doc__, "dp=2,tp=4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)  # unknown flags are an error
    mesh = _cli.make_mesh(args)
    say = _cli.say_fn(mesh)
    say(_cli.mode_line(mesh))
    say(mesh)
    say()

    cfg = gpt.Config(layers=args.layers, heads=4, d=16)
    params = gpt.init(cfg)
    pspec = strategy_specs("dp-tp", params, args.mesh)
    sspec = OPT.state_specs(pspec)
    bspec = P("dp") if "dp" in args.mesh else P()
    in_specs, out_specs = (pspec, sspec, bspec, bspec), (pspec, sspec, P())
    step = sharded(make_step(cfg), mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    say("parameter shardings (batch split over dp, Megatron-style tensor parallelism over tp):")
    say(_cli.spec_table(params, pspec, mesh))
    say()

    state = OPT.init(params)
    start = time.perf_counter()
    lowered = step.lower(params, state, *batch(0, cfg))
    say(f"compiled in {time.perf_counter() - start:.1f} s")
    say(lowered.explain(summary=True))
    say()

    sharded_params, sharded_state = params, state
    for i in range(args.steps):
        sharded_params, sharded_state, loss = step(sharded_params, sharded_state, *batch(i, cfg))
        say(f"step {i + 1}/{args.steps}: loss {_cli.full(loss).item():.4f}")

    plain = make_step(cfg)  # the same function, run unsharded by PyTorch alone
    ref_params, ref_state = params, state
    for i in range(args.steps):
        ref_params, ref_state, ref_loss = plain(ref_params, ref_state, *batch(i, cfg))
    diff = _cli.max_difference(sharded_params, ref_params)
    final = {k: _cli.full(v) for k, v in sharded_params.items()}
    torch.testing.assert_close(final, ref_params, rtol=1e-4, atol=1e-5)
    say(
        f"equivalent: after {args.steps} steps every parameter equals the unsharded run "
        f"(largest difference {diff:.1e}, float rounding; loss {ref_loss.item():.4f} unsharded)"
    )


if __name__ == "__main__":
    main()
