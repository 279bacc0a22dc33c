"""Train the example GPT with @sharded, checkpointing every K steps and resuming from the newest one.

python -m examples.train_gpt --simulate --mesh dp=2,tp=2 --steps 8 --ckpt /tmp/gpt --ckpt-every 2
torchrun --nproc-per-node 4 --max-restarts 1 -m examples.train_gpt --mesh dp=2,tp=2 \\
    --steps 8 --ckpt /tmp/gpt --ckpt-every 2

Parameters are split Megatron-style over a ``tp`` axis (when the mesh has one) and the batch over
``dp``. A restarted run (torchrun ``--max-restarts``, or running the command again) continues from
the newest complete checkpoint in ``--ckpt``; since the data of step ``i`` depends only on ``i``, it
ends with the same parameters as an uninterrupted run. ``--kill-step`` makes one rank SIGKILL itself
on the first attempt, to try exactly that.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any
from unittest import mock

import torch

import shardspec
from examples.models import gpt
from shardspec import Mesh, P, checkpoint, optim, sharded

OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
BATCH = 8
COLUMN = ("qkv.weight", "qkv.bias", "fc.weight", "fc.bias")  # output rows split: heads / hidden units
ROW = ("attn.proj.weight", "mlp.proj.weight")  # input columns split: the partial sum is reduced once


def parse_mesh(text: str) -> dict[str, int]:
    """``dp=2,tp=2`` -> {"dp": 2, "tp": 2}."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip().isidentifier() or not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: write axes as name=size pairs, e.g. dp=2,tp=2")
        axes[name.strip()] = int(size)
    return axes


def param_specs(params: dict[str, torch.Tensor], axes: dict[str, int]) -> dict[str, P]:
    def spec(name: str) -> P:
        if "tp" not in axes:
            return P()
        if name.endswith(COLUMN):
            return P("tp")
        return P(None, "tp") if name.endswith(ROW) else P()

    return {name: spec(name) for name in params}


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", type=parse_mesh, default={"dp": 2, "tp": 2}, help="e.g. dp=2,tp=2")
    ap.add_argument("--simulate", action="store_true", help="virtual devices in this process")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2, help="transformer blocks (fewer compile faster)")
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
    if args.kill_step is not None and args.simulate:
        ap.error("--kill-step needs real processes (torchrun), not --simulate")
    if args.kill_during_save and not (args.ckpt and args.ckpt_every and args.kill_step):
        ap.error("--kill-during-save needs --ckpt, --ckpt-every and --kill-step")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    mesh = Mesh(args.mesh, simulate=args.simulate)
    rank = 0 if mesh.simulated else mesh.rank
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    if mesh.simulated:
        say(f"mode: simulated ({mesh.describe()}: {mesh.size} virtual devices in one process)")
    else:
        backend = torch.distributed.get_backend()
        say(f"mode: real ({mesh.describe()}: {mesh.size} processes, {backend}, attempt {attempt})")

    cfg = gpt.Config(layers=args.layers)
    params = gpt.init(cfg)
    pspec = param_specs(params, args.mesh)
    sspec = OPT.state_specs(pspec)
    bspec = P("dp") if "dp" in args.mesh else P()
    step_fn = sharded(
        make_step(cfg), mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P())
    )
    state, start = OPT.init(params), 0
    found = checkpoint.find(args.ckpt) if args.ckpt else None
    if found is not None:
        like = {"params": params, "opt": state}
        tree, start = checkpoint.load(
            args.ckpt, like=like, mesh=mesh, specs={"params": pspec, "opt": sspec}, restore_rng=True
        )
        params, state = tree["params"], tree["opt"]
        say(f"resumed from {found} (step {start})")

    fault = args.kill_step is not None and rank == args.kill_rank and attempt == 0
    for i in range(start, args.steps):
        if fault and i == args.kill_step and not args.kill_during_save:
            _die(f"before step {i + 1}")
        params, state, loss = step_fn(params, state, *batch(i, cfg))
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
    main()
