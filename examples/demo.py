"""shardspec in one run: a small GPT trained data- and tensor-parallel on a simulated 8-device mesh.

python examples/demo.py                      # dp=2 x tp=4, simulated
python examples/demo.py --mesh dp=4,tp=2 --steps 5
python examples/demo.py --mesh dp=2,pp=2,tp=2 --schedule 1f1b --microbatches 4   # + pipeline
torchrun --nproc-per-node 8 examples/demo.py   # the same on 8 real processes

It prints the mesh, where each parameter lives, every collective the compiler inserted grouped by
the model line that needs it, one line per training step, and finally checks the sharded result
against the same steps run unsharded in plain PyTorch.

A ``pp`` axis in ``--mesh`` pipelines the GPT over it: a ``pipeline_boundary`` after each block,
``--microbatches`` microbatches per step run in the ``--schedule`` order; the demo also prints the
stages with their balance and each position's action list. The unsharded reference is then the
same step run eagerly, where the boundaries do nothing and the microbatches are gradient
accumulation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # `python examples/demo.py` as well as `python -m examples.demo`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Any

import torch
import torch.nn.functional as F

import shardspec
from examples import _cli
from examples.models import gpt
from examples.train_gpt import BATCH, OPT, batch, make_step, strategy_specs
from shardspec import P, Pipeline, sharded

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")


def pipelined_loss(
    p: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor, cfg: gpt.Config
) -> torch.Tensor:
    """``gpt.loss_fn`` with a ``pipeline_boundary`` after every block: the cuts the pipeline may
    take (a no-op without ``pipeline=``, so eagerly this is ``gpt.loss_fn``)."""
    x = F.embedding(tokens, p["wte"]) + p["wpe"][: tokens.shape[1]]
    for i in range(cfg.layers):
        x = shardspec.pipeline_boundary(gpt.block(p, f"h.{i}.", x, cfg.heads))
    x = F.layer_norm(x, (cfg.d,), p["ln_f.weight"], p["ln_f.bias"])
    logits = F.linear(x, p["head.weight"])
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))


def make_pipelined_step(cfg: gpt.Config, microbatches: int) -> Any:
    """The demo's step with its gradient the mean over ``microbatches`` microbatches."""

    def train_step(params: Any, state: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        grad_fn = shardspec.value_and_grad(pipelined_loss, microbatches=microbatches)
        loss, grads = grad_fn(params, tokens, targets, cfg)
        params, state = OPT.update(grads, state, params)
        return params, state, loss

    return train_step


def _checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Usage errors before anything compiles: axes the demo has no use for, pipeline flags without a
    pp axis, microbatches that do not split the batch, too few blocks for the stages."""
    other = sorted(set(args.mesh) - {"dp", "tp", "pp"})
    if other:
        ap.error(f"--mesh: the demo splits the batch over dp, layers over tp, blocks over pp; not {other}")
    pp = "pp" in args.mesh
    given = [f for f in ("schedule", "microbatches", "virtual_stages") if getattr(args, f) is not None]
    if given and not pp:
        flag = "--" + given[0].replace("_", "-")
        ap.error(f"{flag} needs a pp axis in --mesh (e.g. --mesh dp=2,pp=2,tp=2)")
    args.schedule = args.schedule or "1f1b"
    args.microbatches = args.microbatches or 4
    args.virtual_stages = args.virtual_stages or 2
    if pp and BATCH % args.microbatches:
        ap.error(f"--microbatches {args.microbatches} does not split the batch of {BATCH} examples evenly")
    stages = args.mesh.get("pp", 1) * (args.virtual_stages if args.schedule == "interleaved" else 1)
    if pp and args.layers < stages - 1:  # one boundary after each block: layers + 1 stages at most
        ap.error(
            f"--schedule {args.schedule} on pp={args.mesh['pp']} needs {stages} stages: "
            f"pass --layers {stages - 1}"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    ap = _cli.parser(__doc__, "dp=2,tp=4")
    ap.add_argument("--steps", type=_cli.positive, default=3)
    ap.add_argument("--layers", type=_cli.positive, default=2)
    ap.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (with pp; default 1f1b)")
    ap.add_argument("--microbatches", type=_cli.positive, help="microbatches per step (with pp; default 4)")
    ap.add_argument("--virtual-stages", type=_cli.positive, help="stages per position (default 2)")
    args = _checked(ap, ap.parse_args(argv))  # unknown flags are an error
    pp = "pp" in args.mesh
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
    train_step = make_pipelined_step(cfg, args.microbatches) if pp else make_step(cfg)
    pipeline = None
    if pp:
        v = args.virtual_stages if args.schedule == "interleaved" else 1
        pipeline = Pipeline("pp", args.schedule, v)
        say(f"pipeline over pp: schedule {args.schedule}, {args.microbatches} microbatches per step")
    step = sharded(train_step, mesh=mesh, in_specs=in_specs, out_specs=out_specs, pipeline=pipeline)
    how = [
        w
        for a, w in (("dp", "batch split over dp"), ("tp", "Megatron-style tensor parallelism over tp"))
        if a in args.mesh
    ]
    say(f"parameter shardings ({', '.join(how) or 'replicated'}):")
    say(_cli.spec_table(params, pspec, mesh))
    say()

    state = OPT.init(params)
    start = time.perf_counter()
    lowered = step.lower(params, state, *batch(0, cfg))
    say(f"compiled in {time.perf_counter() - start:.1f} s")
    say(lowered.explain(summary=True))  # with pp: the stages, their costs and the balance last
    say()
    if pp:
        say("pipeline schedule (F forward, B backward, W weight gradient: stage.microbatch):")
        say(lowered.pipeline_schedule().as_text())
        say()

    sharded_params, sharded_state = params, state
    for i in range(args.steps):
        sharded_params, sharded_state, loss = step(sharded_params, sharded_state, *batch(i, cfg))
        say(f"step {i + 1}/{args.steps}: loss {_cli.full(loss).item():.4f}")

    plain = train_step  # the same function, run unsharded by PyTorch alone
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
    _cli.run(main)
