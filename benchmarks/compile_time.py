"""Compile time of a GPT training step: ``lower()`` by stage against a plain ``make_fx`` trace.

    python -m benchmarks.compile_time --layers 24 --d 256 --devices 8,64

Builds the example GPT's training step (``value_and_grad`` + AdamW, data parallel over ``dp``), warms
up on a 1-layer step (imports and dispatch caches are paid once per process, not per compile), then
measures, in the same process: a plain ``make_fx(tracing_mode="fake")`` trace of the unsharded step,
and ``lower()`` on simulated meshes of each device count, split into trace / propagate / partition /
passes. Prints one row per mesh and the ratios the targets speak of (lower / make_fx, and the
largest mesh / the smallest).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import compiler.program as program
import shardspec
from examples.models import gpt
from shardspec import Mesh, P, optim, sharded

STAGES = ("trace", "propagate", "partition")


@contextlib.contextmanager
def stage_timer() -> Iterator[dict[str, float]]:
    """Seconds spent in each compile stage while the block runs."""
    times: dict[str, float] = {}
    saved: dict[str, Any] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - t0

        return run

    for name in STAGES:
        saved[name] = getattr(program, name)
        setattr(program, name, timed(name, saved[name]))
    saved["passes"] = program.program_passes.optimize_programs
    program.program_passes.optimize_programs = timed("passes", saved["passes"])
    try:
        yield times
    finally:
        for name in STAGES:
            setattr(program, name, saved[name])
        program.program_passes.optimize_programs = saved["passes"]


def gpt_step(cfg: gpt.Config, devices: int) -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
    """The training step, its arguments and the shardspec-compiled version for ``devices``."""
    opt = optim.adamw(lr=1e-3, eps=1e-6, weight_decay=0.01)
    params = gpt.init(cfg)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab, (devices, cfg.seq), generator=g)

    def step(p: Any, s: Any, tok: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(gpt.loss_fn)(p, tok, tok, cfg)
        return (*opt.update(grads, s, p), loss)

    pspec = {k: P() for k in params}
    sspec = opt.state_specs(pspec)
    f = sharded(
        step,
        mesh=Mesh({"dp": devices}, simulate=True),
        in_specs=(pspec, sspec, P("dp")),
        out_specs=(pspec, sspec, P()),
    )
    return step, (params, opt.init(params), tok), f


def measure(cfg: gpt.Config, devices: list[int]) -> dict[str, Any]:
    from torch.fx.experimental.proxy_tensor import make_fx

    warm = gpt.Config(vocab=cfg.vocab, seq=cfg.seq, d=cfg.d, heads=cfg.heads, layers=1)
    _, args, f = gpt_step(warm, devices[0])
    f.lower(*args)
    step, args, _ = gpt_step(cfg, devices[0])
    t0 = time.perf_counter()
    make_fx(step, tracing_mode="fake")(*args)
    plain = time.perf_counter() - t0
    rows = []
    for n in devices:
        _, args, f = gpt_step(cfg, n)
        with stage_timer() as stages:
            t0 = time.perf_counter()
            f.lower(*args)
            total = time.perf_counter() - t0
        rows.append({"devices": n, "lower_s": total, **{k: round(v, 3) for k, v in stages.items()}})
    return {
        "layers": cfg.layers,
        "d": cfg.d,
        "make_fx_s": plain,
        "rows": rows,
        "lower_over_make_fx": rows[0]["lower_s"] / plain,
        "largest_over_smallest_mesh": rows[-1]["lower_s"] / rows[0]["lower_s"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--devices", default="8,64")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = gpt.Config(vocab=a.vocab, seq=a.seq, d=a.d, heads=a.heads, layers=a.layers)
    out = measure(cfg, [int(x) for x in a.devices.split(",")])
    print(f"GPT {cfg.layers} layers, d {cfg.d}: plain make_fx trace {out['make_fx_s']:.2f} s")
    print("| devices | lower s | trace s | propagate s | partition s | passes s |")
    print("|---|---|---|---|---|---|")
    for r in out["rows"]:
        print(
            f"| {r['devices']} | {r['lower_s']:.2f} | {r.get('trace', 0):.2f} | "
            f"{r.get('propagate', 0):.2f} | {r.get('partition', 0):.2f} | {r.get('passes', 0):.2f} |"
        )
    print(
        f"lower / make_fx: {out['lower_over_make_fx']:.2f}x; "
        f"{out['rows'][-1]['devices']} / {out['rows'][0]['devices']} devices: "
        f"{out['largest_over_smallest_mesh']:.2f}x"
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
