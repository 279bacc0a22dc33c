"""Bytes per rank, launches and modeled step time of every strategy configuration, and the planner's
compile time on a deep GPT (the figures of docs/planner.md).

    python -m benchmarks.planner_table                 # greedy propagation, every configuration
    python -m benchmarks.planner_table --planner       # the planner too (default machine)
    python -m benchmarks.planner_table --layers 2,24   # lower() with and without the planner

Configurations: the MLP strategies of tests/test_sharded_comm.py (8-16-4, batch 16, 4 devices),
ZeRO-3 over ("dp", "tp"), DP at batch 8 (16-32-8), and GPT and Llama (2 layers) under the six spec
configurations of tests/transformer_specs.py on a simulated dp=2 x tp=2 mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import shardspec
from examples.models import gpt, llama, mlp
from shardspec import CostModel, Mesh, P, optim, sharded
from tests import mlp_strategies
from tests.transformer_specs import configurations

MLP_OPT = optim.adamw(lr=1e-2, weight_decay=0.0)
LM_OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
Case = tuple[str, Callable[[Any], Any]]  # name, cost_model -> Lowered


def _mlp(
    mesh: dict[str, int], pspec: Any, sspec: Any, bspec: P, sizes: tuple[int, int, int], batch: int
) -> Any:
    step = mlp.make_step(MLP_OPT)

    def lower(model: Any) -> Any:
        torch.manual_seed(0)
        params = mlp.init(*sizes)
        x, y = torch.randn(batch, sizes[0]), torch.randint(0, sizes[2], (batch,))
        f = sharded(
            step,
            mesh=Mesh(mesh, simulate=True),
            in_specs=(pspec, sspec, bspec, bspec),
            out_specs=(pspec, sspec, P()),
            cost_model=model,
        )
        return f.lower(params, MLP_OPT.init(params), x, y)

    return lower


def _lm(mod: Any, config: str, layers: int = 2) -> Any:
    cfg = dataclasses.replace(mod.Config(), layers=layers)
    params = mod.init(cfg)
    pspec, bspec, residual = configurations(params)[config]
    cfg = dataclasses.replace(cfg, residual=residual)

    def step(p: Any, s: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(lambda p, a, b: mod.loss_fn(p, a, b, cfg))(p, tok, tgt)
        p, s = LM_OPT.update(grads, s, p)
        return p, s, loss

    def lower(model: Any) -> Any:
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g)
        tgt = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g)
        f = sharded(
            step,
            mesh=Mesh({"dp": 2, "tp": 2}, simulate=True),
            in_specs=(pspec, LM_OPT.state_specs(pspec), bspec, bspec),
            out_specs=(pspec, LM_OPT.state_specs(pspec), P()),
            cost_model=model,
        )
        return f.lower(params, LM_OPT.init(params), tok, tgt)

    return lower


def cases() -> Iterator[Case]:
    for s in ("dp", "zero3", "megatron", "dp_x_tp"):
        mesh, ps, ss, bs = mlp_strategies.specs(s, MLP_OPT)
        yield f"mlp {s}", _mlp(mesh, ps, ss, bs, (8, 16, 4), 16)
    rep = {"w1": P(), "b1": P(), "w2": P()}
    split = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
    yield "mlp zero1", _mlp({"dp": 4}, rep, MLP_OPT.state_specs(split), P("dp"), (8, 16, 4), 16)
    tup = {"w1": P(("dp", "tp")), "b1": P(("dp", "tp")), "w2": P(("dp", "tp"))}
    yield (
        "mlp zero3 over (dp, tp)",
        _mlp({"dp": 2, "tp": 2}, tup, MLP_OPT.state_specs(tup), P("dp"), (8, 16, 4), 16),
    )
    yield "mlp dp batch 8", _mlp({"dp": 4}, rep, MLP_OPT.state_specs(rep), P("dp"), (16, 32, 8), 8)
    for name, mod in (("gpt", gpt), ("llama", llama)):
        for config in ("dp", "tp_megatron", "sequence_parallel", "zero3", "dp_x_tp", "heads_split"):
            yield f"{name} {config}", _lm(mod, config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--planner", action="store_true", help="also lower with CostModel() (the planner)")
    ap.add_argument(
        "--layers", default="", help="comma-separated GPT depths: time lower() with/without the planner"
    )
    args = ap.parse_args()
    if args.layers:
        _lm(gpt, "dp", 1)(None)  # warm up: imports and dispatch caches are paid once per process
        print("| layers | lower s (greedy) | lower s (planner) | planner / greedy |")
        print("|---|---|---|---|")
        for n in (int(x) for x in args.layers.split(",")):
            lower = _lm(gpt, "dp_x_tp", n)
            t0 = time.perf_counter()
            lower(None)
            t1 = time.perf_counter()
            lower(CostModel())
            t2 = time.perf_counter()
            print(f"| {n} | {t1 - t0:.2f} | {t2 - t1:.2f} | {(t2 - t1) / (t1 - t0):.2f} |", flush=True)
        return
    models = [None, CostModel()] if args.planner else [None]
    print("| configuration | machine | bytes per rank | launches | modeled step (us) |")
    print("|---|---|---|---|---|")
    for name, lower in cases():
        for model in models:
            c = lower(model).cost()
            who = "planner" if model is not None else "greedy"
            print(
                f"| {name} | {who} | {c.comm_bytes_per_rank:,.0f} | {c.collective_count} | "
                f"{c.modeled_time_s * 1e6:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
