"""Train the example GPT with @sharded under any strategy, checkpointing every K steps and resuming.

python -m examples.train_gpt --mesh dp=2,tp=2 --strategy dp-tp       # simulated (4 virtual devices)
python -m examples.train_gpt --mesh dp=4 --strategy zero3 --steps 4
torchrun --nproc-per-node 4 --max-restarts 1 -m examples.train_gpt --mesh dp=2,tp=2 \\
    --steps 8 --ckpt /tmp/gpt --ckpt-every 2
torchrun --nproc-per-node 6 -m examples.train_gpt --strategy zero3   # mesh dp=6 from the world size

Strategies (``--strategy``; the batch is always split over ``dp`` when the mesh has it):
  dp      parameters replicated (data parallelism)
  zero1   optimizer state split over dp (ZeRO-1)
  zero3   parameters and optimizer state split over dp (ZeRO-3 / FSDP)
  tp      Megatron tensor parallelism over ``tp``: attention heads and MLP hidden units split
  dp-tp   tp, with the batch over dp (the default)
  tp-sp   dp-tp plus sequence parallelism: the residual stream split over the sequence on tp
  zero3-tp  2D: tp as above, and every parameter also split over dp (FSDP + TP)

``--dropout 0.1`` adds dropout (embeddings, attention and MLP outputs); the masks come from a key
derived from the step number, counter-based, so they are the same on every mesh and after a resume.

Under torchrun without ``--mesh`` the mesh is ``dp=W`` (or ``dp=W/2,tp=2`` for tp strategies) for a
world size W. Without torchrun the run is simulated (or pass ``--simulate`` / ``--real``).

A restarted run (torchrun ``--max-restarts``, or running the command again) continues from
the newest complete checkpoint in ``--ckpt``; since the data of step ``i`` depends only on ``i``, it
ends with the same parameters as an uninterrupted run. ``--kill-step`` makes one rank SIGKILL itself
on the first attempt, to try exactly that.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python examples/train_gpt.py` as well as `python -m examples.train_gpt`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import signal
from typing import Any
from unittest import mock

import torch

import shardspec
from examples import _cli
from examples.models import gpt, gpt_dropout
from shardspec import P, checkpoint, optim, sharded

OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
BATCH = 8
COLUMN = ("qkv.weight", "qkv.bias", "fc.weight", "fc.bias")  # output rows split: heads / hidden units
ROW = ("attn.proj.weight", "mlp.proj.weight")  # input columns split: the partial sum is reduced once


STRATEGIES = ("dp", "zero1", "zero3", "tp", "dp-tp", "tp-sp", "zero3-tp")
NEEDS = {"tp": ("tp", "dp-tp", "tp-sp", "zero3-tp"), "dp": ("dp", "zero1", "zero3", "zero3-tp")}  # mesh axes
parse_mesh = _cli.parse_mesh


def param_specs(params: dict[str, torch.Tensor], axes: dict[str, int]) -> dict[str, P]:
    """Megatron tensor parallelism over ``tp`` (when the mesh has it); other parameters replicated."""
    return strategy_specs("dp-tp", params, axes)


def strategy_specs(strategy: str, params: dict[str, torch.Tensor], axes: dict[str, int]) -> dict[str, P]:
    """The parameter specs of ``strategy`` on a mesh with ``axes``."""
    tp = "tp" in axes and strategy in ("tp", "dp-tp", "tp-sp", "zero3-tp")
    fsdp = "dp" in axes and strategy in ("zero3", "zero3-tp")

    def spec(name: str) -> P:
        if tp and name.endswith(COLUMN):
            return P("tp", "dp") if fsdp and params[name].dim() == 2 else P("tp")
        if tp and name.endswith(ROW):
            return P("dp", "tp") if fsdp else P(None, "tp")
        return P("dp") if fsdp else P()

    return {name: spec(name) for name in params}


def state_specs(strategy: str, pspec: dict[str, P], axes: dict[str, int]) -> Any:
    """Optimizer state mirrors the parameters, except ZeRO-1 splits it over dp alone."""
    if strategy == "zero1" and "dp" in axes:
        return OPT.state_specs({name: P("dp") for name in pspec})
    return OPT.state_specs(pspec)


def batch(step: int, cfg: gpt.Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of step ``step``: a function of the step alone, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab, (BATCH, cfg.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def make_step(cfg: gpt.Config) -> Any:
    def train_step(params: Any, state: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(gpt.loss_fn)(params, tokens, targets, cfg)
        params, state = OPT.update(grads, state, params)
        return params, state, loss

    return train_step


def make_dropout_step(cfg: gpt.Config, rate: float) -> Any:
    """The step with dropout (``examples/models/gpt_dropout.py``): masks drawn from ``key``."""

    def train_step(params: Any, state: Any, tokens: torch.Tensor, targets: torch.Tensor, key: Any) -> Any:
        loss, grads = shardspec.value_and_grad(gpt_dropout.loss_fn)(params, tokens, targets, key, cfg, rate)
        params, state = OPT.update(grads, state, params)
        return params, state, loss

    return train_step


def step_key(step: int) -> torch.Tensor:
    """The random key of step ``step``: a function of the step alone, so a resumed run draws the same."""
    return shardspec.random.fold_in(shardspec.random.key(0), step)


def _die(where: str) -> None:
    print(f"rank {os.environ.get('RANK')}: killing myself (SIGKILL) {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_after_writing() -> Any:
    """Fault injection: SIGKILL this rank right after it wrote its shards, mid-save."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        original(self, plan, planner).wait()
        _die("in the middle of a checkpoint save")

    return mock.patch.object(FileSystemWriter, "write_data", write_data)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _cli.parser(__doc__, "dp=2,tp=2")
    ap.set_defaults(mesh=None)
    ap.add_argument("--strategy", choices=STRATEGIES, default="dp-tp")
    ap.add_argument("--steps", type=_cli.positive, default=8)
    ap.add_argument("--layers", type=_cli.positive, default=2, help="transformer blocks (fewer: faster)")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout rate (masks the same on every mesh)")
    ap.add_argument("--ckpt", help="checkpoint root directory (resumes from its newest checkpoint)")
    ap.add_argument("--ckpt-every", type=int, default=0, metavar="K", help="save every K steps")
    ap.add_argument("--out", help="write the final parameters (global tensors) to this file")
    ap.add_argument(
        "--kill-step", type=int, help="fault injection: die after this many steps (first attempt only)"
    )
    ap.add_argument("--kill-rank", type=int, default=1, help="the rank that dies (default 1)")
    ap.add_argument(
        "--kill-during-save", action="store_true", help="die inside the save after --kill-step steps"
    )
    args = ap.parse_args(argv)  # unknown flags are an error
    if args.mesh is None:
        args.mesh = _default_mesh(args.strategy)
    for axis, needs in NEEDS.items():
        if args.strategy in needs and axis not in args.mesh:  # else it would run another strategy
            mesh = ",".join(f"{k}={v}" for k, v in args.mesh.items())
            ap.error(f"--strategy {args.strategy} splits over a {axis!r} mesh axis; the mesh {mesh} has none")
    if args.kill_step is not None and args.simulate:
        ap.error("--kill-step needs real processes (torchrun), not --simulate")
    if args.kill_during_save and not (args.ckpt and args.ckpt_every and args.kill_step):
        ap.error("--kill-during-save needs --ckpt, --ckpt-every and --kill-step")
    if args.kill_during_save and args.kill_step % args.ckpt_every:
        ap.error(f"--kill-during-save: no save after step {args.kill_step} (every {args.ckpt_every} steps)")
    if args.ckpt_every < 0 or (args.ckpt_every and not args.ckpt):
        ap.error("--ckpt-every K saves every K >= 1 steps into --ckpt DIR (give both)")
    return args


def _default_mesh(strategy: str) -> dict[str, int]:
    """dp=2,tp=2 simulated; under torchrun, the world size W as dp=W (or dp=W/2,tp=2 for tp)."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world == 0:
        return {"dp": 2, "tp": 2}
    if "tp" in strategy and world % 2 == 0:
        return {"dp": world // 2, "tp": 2}  # dp=1 at world 2: dp-tp and zero3-tp name the axis
    return {"dp": world}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mesh = _cli.make_mesh(args)
    rank = 0 if mesh.simulated else mesh.rank
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(_cli.mode_line(mesh, f", attempt {attempt}"))
    say(f"strategy: {args.strategy}")

    sp = args.strategy == "tp-sp" and "tp" in args.mesh
    residual = P("dp" if "dp" in args.mesh else None, "tp") if sp else None
    cfg = gpt.Config(layers=args.layers, residual=residual)
    params = gpt.init(cfg)
    pspec = strategy_specs(args.strategy, params, args.mesh)
    sspec = state_specs(args.strategy, pspec, args.mesh)
    bspec = P("dp") if "dp" in args.mesh else P()
    if args.dropout:
        fn, in_specs = make_dropout_step(cfg, args.dropout), (pspec, sspec, bspec, bspec, P())
    else:
        fn, in_specs = make_step(cfg), (pspec, sspec, bspec, bspec)
    step_fn = sharded(fn, mesh=mesh, in_specs=in_specs, out_specs=(pspec, sspec, P()))
    state, start = OPT.init(params), 0
    found = checkpoint.find(args.ckpt) if args.ckpt else None
    if found is not None:
        like = {"params": params, "opt": state}
        tree, start = checkpoint.load(
            args.ckpt, like=like, mesh=mesh, specs={"params": pspec, "opt": sspec}, restore_rng=True
        )
        params, state = tree["params"], tree["opt"]
        say(f"resumed from {found} (step {start})")

    if args.kill_step is not None and not 0 <= args.kill_rank < (1 if mesh.simulated else mesh.size):
        raise SystemExit(f"--kill-rank {args.kill_rank}: no such rank in {mesh.describe()}")
    fault = args.kill_step is not None and rank == args.kill_rank and attempt == 0
    for i in range(start, args.steps):
        if fault and i == args.kill_step and not args.kill_during_save:
            _die(f"before step {i + 1}")
        key = (step_key(i),) if args.dropout else ()
        params, state, loss = step_fn(params, state, *batch(i, cfg), *key)
        value = loss if mesh.simulated else loss.full_tensor()
        say(f"step {i + 1}: loss {value.item():.4f}", flush=True)
        if args.ckpt and args.ckpt_every and (i + 1) % args.ckpt_every == 0:
            tree = {"params": params, "opt": state}
            if fault and args.kill_during_save and i + 1 == args.kill_step:
                with _die_after_writing():
                    checkpoint.save(args.ckpt, tree, step=i + 1)
            checkpoint.save(args.ckpt, tree, step=i + 1)
            say(f"saved step {i + 1}")

    if args.out:
        final = {k: v if mesh.simulated else v.full_tensor() for k, v in params.items()}
        if rank == 0:
            torch.save(final, args.out)
            say(f"wrote {args.out}")


if __name__ == "__main__":
    _cli.run(main)
