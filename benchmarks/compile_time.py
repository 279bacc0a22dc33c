"""Compile time of a GPT training step: ``lower()`` by stage against a plain ``make_fx`` trace.

    python -m benchmarks.compile_time --layers 24 --d 256 --devices 8,64 --rounds 3

Builds the example GPT's training step (``value_and_grad`` + AdamW, data parallel over ``dp``), warms
up on a 1-layer step (imports and dispatch caches are paid once per process, not per compile), then
alternates, ``--rounds`` times in the same process: a plain ``make_fx(tracing_mode="fake")`` trace of
the unsharded step, and ``lower()`` on simulated meshes of each device count, split into trace /
propagate / partition / passes, plus the Python code generation of the per-rank program (deferred to
its first run: ``codegen``). Each time is wall clock and process CPU time (on a loaded machine the
CPU time is the steadier of the two). Prints one row per mesh (medians over rounds) and the ratios
the targets speak of (lower / make_fx per round, and the largest mesh / the smallest), with the
load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

import compiler.program as program
import shardspec
from examples.models import gpt
from shardspec import Mesh, P, optim, sharded

STAGES = ("trace", "propagate", "partition")


@contextlib.contextmanager
def stage_timer() -> Iterator[dict[str, float]]:
    """Wall seconds (``name``) and CPU seconds (``name_cpu``) spent in each compile stage while the
    block runs."""
    times: dict[str, float] = {}
    saved: dict[str, Any] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - t0
                times[name + "_cpu"] = times.get(name + "_cpu", 0.0) + time.process_time() - c0

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


def _clock(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its wall seconds and its CPU seconds."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


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


def measure(cfg: gpt.Config, devices: list[int], rounds: int = 1) -> dict[str, Any]:
    from torch.fx.experimental.proxy_tensor import make_fx

    warm = gpt.Config(vocab=cfg.vocab, seq=cfg.seq, d=cfg.d, heads=cfg.heads, layers=1)
    _, args, f = gpt_step(warm, devices[0])
    f.lower(*args)
    load_before = os.getloadavg()[0]
    step, plain_args, _ = gpt_step(cfg, devices[0])
    runs: list[dict[str, Any]] = []
    for _ in range(rounds):  # alternate: plain trace, then each mesh, every round
        _, wall, cpu = _clock(lambda: make_fx(step, tracing_mode="fake")(*plain_args))
        run: dict[str, Any] = {"make_fx_s": wall, "make_fx_cpu_s": cpu, "rows": []}
        for n in devices:
            _, args, f = gpt_step(cfg, n)
            with stage_timer() as stages:
                low, total, total_cpu = _clock(lambda f=f, args=args: f.lower(*args))
            programs = list(dict.fromkeys(low.program.programs))
            _, gen, gen_cpu = _clock(lambda ps=programs: [_LazyGraphModule.force_recompile(p) for p in ps])
            row = {"lower_s": total, "lower_cpu_s": total_cpu}
            row.update(codegen_s=gen, codegen_cpu_s=gen_cpu, **{k: round(v, 3) for k, v in stages.items()})
            run["rows"].append(row)
        runs.append(run)
    rows = [
        {"devices": n} | {k: statistics.median(r["rows"][i][k] for r in runs) for k in runs[0]["rows"][i]}
        for i, n in enumerate(devices)
    ]
    # the per-rank program's code is generated at its first run: counted in, as lower() once did it
    ratio = [(r["rows"][0]["lower_s"] + r["rows"][0]["codegen_s"]) / r["make_fx_s"] for r in runs]
    ratio_cpu = [
        (r["rows"][0]["lower_cpu_s"] + r["rows"][0]["codegen_cpu_s"]) / r["make_fx_cpu_s"] for r in runs
    ]
    mesh = [r["rows"][-1]["lower_s"] / r["rows"][0]["lower_s"] for r in runs]
    mesh_cpu = [r["rows"][-1]["lower_cpu_s"] / r["rows"][0]["lower_cpu_s"] for r in runs]
    return {
        "layers": cfg.layers,
        "d": cfg.d,
        "rounds": rounds,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "make_fx_s": statistics.median(r["make_fx_s"] for r in runs),
        "make_fx_cpu_s": statistics.median(r["make_fx_cpu_s"] for r in runs),
        "rows": rows,
        "runs": runs,
        "lower_over_make_fx": statistics.median(ratio),
        "lower_over_make_fx_cpu": statistics.median(ratio_cpu),
        "lower_over_make_fx_per_round": ratio,
        "largest_over_smallest_mesh": statistics.median(mesh),
        "largest_over_smallest_mesh_cpu": statistics.median(mesh_cpu),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--devices", default="8,64")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = gpt.Config(vocab=a.vocab, seq=a.seq, d=a.d, heads=a.heads, layers=a.layers)
    out = measure(cfg, [int(x) for x in a.devices.split(",")], a.rounds)
    print(
        f"GPT {cfg.layers} layers, d {cfg.d}, {a.rounds} round(s), load average "
        f"{out['load_before']:.1f} -> {out['load_after']:.1f}: plain make_fx trace "
        f"{out['make_fx_s']:.2f} s (CPU {out['make_fx_cpu_s']:.2f} s)"
    )
    cols = ("lower", "trace", "propagate", "partition", "passes", "codegen")
    print("| devices | " + " | ".join(f"{c} s (CPU s)" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in out["rows"]:
        cells = [
            f"{r.get(c + '_s', r.get(c, 0)):.2f} ({r.get(c + '_cpu_s', r.get(c + '_cpu', 0)):.2f})"
            for c in cols
        ]
        print(f"| {r['devices']} | " + " | ".join(cells) + " |")
    per_round = ", ".join(f"{x:.2f}" for x in out["lower_over_make_fx_per_round"])
    print(
        f"(lower + codegen) / make_fx: {out['lower_over_make_fx']:.2f}x wall (rounds: {per_round}), "
        f"{out['lower_over_make_fx_cpu']:.2f}x CPU; {out['rows'][-1]['devices']} / "
        f"{out['rows'][0]['devices']} devices: {out['largest_over_smallest_mesh']:.2f}x wall, "
        f"{out['largest_over_smallest_mesh_cpu']:.2f}x CPU"
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
