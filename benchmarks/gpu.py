"""Checks and timings that need a CUDA GPU: NCCL at world size 1, the example GPT's step on the GPU
against the eager ``nn.Module`` step, and bf16 mixed-precision numerics of a sharded step.

    python -m benchmarks.gpu --json out.json            # on a machine with one CUDA GPU

Each section records what it saw in the JSON (and prints it), so a failure in one does not hide the
others. Sections:

- ``simulated``: a 2-layer GPT step (value_and_grad + AdamW) on a simulated dp=2 x tp=2 mesh whose
  virtual devices all live on the GPU, against the same step unsharded on the GPU (fp32).
- ``nccl``: the same step on a real 1-device mesh (NCCL process group of world size 1): results
  come back as CUDA DTensors equal to the unsharded step.
- ``speed``: step time of ``@sharded`` on a 1-device mesh (the per-rank program on the GPU) against
  the eager ``nn.Module`` GPT with ``torch.optim.AdamW`` (default: foreach on CUDA), in rounds whose
  order rotates, median and min, with each side's peak allocated GPU memory per step above what
  was allocated before it (neither side holds gradients between steps);
  ``--backends eager,inductor`` times ours under each ``sharded(backend=...)``.
- ``bf16``: a mixed-precision step (fp32 master parameters and AdamW state, bf16 compute by a cast
  in the step) sharded on dp=2 x tp=2 against the same step unsharded: the difference is compared
  with the difference between the bf16 step and an fp32 step, i.e. with bf16's own rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import shardspec
from examples.models import gpt
from shardspec import Mesh, P, optim, sharded

DEV = "cuda"  # --device cpu dry-runs every section on the CPU
HYPER: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}
COLUMN = ("attn.qkv.weight", "mlp.fc.weight", "attn.qkv.bias", "mlp.fc.bias")
ROW = ("attn.proj.weight", "mlp.proj.weight")


def megatron_dp(params: dict[str, torch.Tensor]) -> dict[str, P]:
    """Megatron over tp (column-parallel in-projections, row-parallel out-projections), rest replicated."""

    def spec(name: str) -> P:
        if name.endswith(COLUMN):
            return P("tp", None) if name.endswith("weight") else P("tp")
        if name.endswith(ROW):
            return P(None, "tp")
        return P()

    return {k: spec(k) for k in params}


def batch(cfg: gpt.Config, rows: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g)
    return tok.to(dev), torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g).to(dev)


def make_step(cfg: gpt.Config, loss: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    opt = optim.adamw(**HYPER)

    def step(p: Any, s: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
        value, grads = shardspec.value_and_grad(loss)(p, tok, tgt, cfg)
        p, s = opt.update(grads, s, p)
        return p, s, value

    return step


def bf16_loss(p: dict[str, torch.Tensor], tok: torch.Tensor, tgt: torch.Tensor, cfg: gpt.Config) -> Any:
    """Mixed precision as a user writes it: fp32 master parameters cast to bf16 for compute."""
    half = {k: v.to(torch.bfloat16) for k, v in p.items()}
    return gpt.loss_fn(half, tok, tgt, cfg).float()


def full(x: Any) -> Any:
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def max_diff(a: Any, b: Any) -> float:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return max(float((full(x).float() - full(y).float()).abs().max()) for x, y in zip(la, lb, strict=True))


def sharded_vs_unsharded(
    cfg: gpt.Config,
    loss: Callable[..., Any],
    mesh: Mesh,
    rows: int,
    donate: tuple[int, ...] = (),
    arg_device: str | None = None,
) -> dict[str, Any]:
    """Two chained steps of ``loss``'s training step sharded on ``mesh`` against the same steps
    unsharded on the GPU; ``arg_device`` passes the first call's arguments from another device."""
    dev = DEV
    params = {k: v.to(dev) for k, v in gpt.init(cfg).items()}
    opt = optim.adamw(**HYPER)
    state = opt.init(params)
    tok, tgt = batch(cfg, rows, dev)
    step = make_step(cfg, loss)
    ref = step(params, state, tok, tgt)
    ref = step(ref[0], ref[1], tok, tgt)
    pspec = megatron_dp(params) if "tp" in mesh.axis_names else {k: P() for k in params}
    data = P("dp") if "dp" in mesh.axis_names else P()
    fn = sharded(
        step,
        mesh=mesh,
        in_specs=(pspec, opt.state_specs(pspec), data, data),
        out_specs=(pspec, opt.state_specs(pspec), P()),
        donate=donate,
    )
    first = (params, state, tok, tgt)
    if arg_device is not None:
        first = torch.utils._pytree.tree_map(lambda t: t.to(arg_device), first)
    collectives = len(fn.lower(*first).collectives())
    t0 = time.perf_counter()
    got = fn(*first)
    compile_s = time.perf_counter() - t0
    got = fn(got[0], got[1], tok, tgt)
    devices = sorted({str(full(x).device) for x in torch.utils._pytree.tree_leaves(got)})
    return {
        "loss": float(full(got[2])),
        "loss_ref": float(ref[2]),
        "max_abs_diff_params_state_loss_after_2_steps": max_diff(got, ref),
        "result_devices": devices,
        "first_call_s": round(compile_s, 2),
        "collectives": collectives,
    }


def section_simulated() -> dict[str, Any]:
    cfg = gpt.Config(vocab=256, seq=64, d=128, heads=4, layers=2)
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    return {
        "dp2 x tp2": sharded_vs_unsharded(cfg, gpt.loss_fn, mesh, rows=4),
        "dp2 x tp2, donated": sharded_vs_unsharded(cfg, gpt.loss_fn, mesh, rows=4, donate=(0, 1)),
    }


def section_nccl() -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cfg = gpt.Config(vocab=256, seq=64, d=128, heads=4, layers=2)
    out = {
        "CUDA arguments": sharded_vs_unsharded(cfg, gpt.loss_fn, Mesh({"dp": 1}), rows=4),
        "CUDA arguments, donated": sharded_vs_unsharded(
            cfg, gpt.loss_fn, Mesh({"dp": 1}), rows=4, donate=(0, 1)
        ),
        "CPU arguments (moved to the GPU)": sharded_vs_unsharded(
            cfg, gpt.loss_fn, Mesh({"dp": 1}), rows=4, arg_device="cpu"
        ),
    }
    out["backend"] = dist.get_backend()  # type: ignore[assignment]
    return out


def _time(fn: Callable[[], Any]) -> tuple[float, int]:
    if DEV != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base


def section_speed(
    cfg: gpt.Config, rows: int, rounds: int, steps: int, backends: tuple[str, ...]
) -> dict[str, Any]:
    """Each backend of ours and the torch step, in rounds whose order rotates (A B C, B C A, ...)."""
    dev = DEV
    tok, tgt = batch(cfg, rows, dev)
    init = {k: v.to(dev) for k, v in gpt.init(cfg).items()}

    # ours: a real 1-device mesh (the NCCL group of the nccl section) when there is one
    import torch.distributed as dist

    mesh = Mesh({"dp": 1}) if dist.is_initialized() else Mesh({"dp": 1}, simulate=True)
    opt = optim.adamw(**HYPER)
    rep = {k: P() for k in init}
    sides: dict[str, Callable[[], None]] = {}
    first_call_s: dict[str, float] = {}
    for backend in backends:
        box: dict[str, Any] = {"p": {k: v.clone() for k, v in init.items()}}
        box["s"] = opt.init(box["p"])
        fn = sharded(
            make_step(cfg, gpt.loss_fn),
            mesh=mesh,
            in_specs=(rep, opt.state_specs(rep), P(), P()),
            out_specs=(rep, opt.state_specs(rep), P()),
            donate=(0, 1),
            backend=backend,
        )

        def step(fn: Any = fn, box: dict[str, Any] = box) -> None:
            box["p"], box["s"], _ = fn(box["p"], box["s"], tok, tgt)

        t0 = time.perf_counter()
        step()  # compiles (and, for inductor, records shapes; the next call compiles the regions)
        step()
        if dev == "cuda":
            torch.cuda.synchronize()
        first_call_s[backend] = round(time.perf_counter() - t0, 2)
        sides[f"ours ({backend})"] = step

    # torch: the nn.Module GPT, autograd, torch.optim.AdamW (CUDA default: foreach)
    model = gpt.GPT(cfg).to(dev)
    model.load_state_dict({k: v.clone() for k, v in init.items()}, strict=True)
    topt = torch.optim.AdamW(model.parameters(), **HYPER)

    def torch_step() -> None:
        F.cross_entropy(model(tok).reshape(-1, cfg.vocab), tgt.reshape(-1)).backward()  # type: ignore[no-untyped-call]
        topt.step()
        topt.zero_grad(set_to_none=True)  # at the end: no gradients held between steps, as ours

    sides["torch"] = torch_step
    for f in sides.values():
        for _ in range(3):
            f()
    names = list(sides)
    times: dict[str, list[float]] = {k: [] for k in names}
    peak: dict[str, int] = dict.fromkeys(names, 0)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(steps):
                t, m = _time(sides[name])
                times[name].append(t)
                peak[name] = max(peak[name], m)
    med = {k: statistics.median(v) for k, v in times.items()}
    mn = {k: min(v) for k, v in times.items()}
    return {
        "mesh": "real (NCCL, world 1)" if not mesh.simulated else "simulated (1 device)",
        "config": {
            "layers": cfg.layers,
            "d": cfg.d,
            "heads": cfg.heads,
            "seq": cfg.seq,
            "vocab": cfg.vocab,
            "batch": rows,
        },
        "ms_median": {k: round(v * 1e3, 3) for k, v in med.items()},
        "ms_min": {k: round(v * 1e3, 3) for k, v in mn.items()},
        "ratio_median_vs_torch": {k: round(med[k] / med["torch"], 3) for k in names if k != "torch"},
        "ratio_min_vs_torch": {k: round(mn[k] / mn["torch"], 3) for k in names if k != "torch"},
        "step_peak_alloc_MiB": {k: round(v / 2**20, 1) for k, v in peak.items()},
        "first_two_calls_s": first_call_s,
        "timed_steps_per_side": rounds * steps,
    }


def section_bf16() -> dict[str, Any]:
    """Errors against the fp32 step: the sharded bf16 step's next to the unsharded bf16 step's."""
    cfg = gpt.Config(vocab=256, seq=64, d=128, heads=4, layers=2)
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    params = {k: v.to(DEV) for k, v in gpt.init(cfg).items()}
    opt = optim.adamw(**HYPER)
    state = opt.init(params)
    tok, tgt = batch(cfg, 4, DEV)
    fp32 = make_step(cfg, gpt.loss_fn)(params, state, tok, tgt)
    plain = make_step(cfg, bf16_loss)(params, state, tok, tgt)
    pspec = megatron_dp(params)
    got = sharded(
        make_step(cfg, bf16_loss),
        mesh=mesh,
        in_specs=(pspec, opt.state_specs(pspec), P("dp"), P("dp")),
        out_specs=(pspec, opt.state_specs(pspec), P()),
    )(params, state, tok, tgt)
    names = ("params", "adamw state", "loss")
    return {
        "max_abs_error_vs_fp32_step": {
            n: {"sharded bf16": max_diff(got[i], fp32[i]), "unsharded bf16": max_diff(plain[i], fp32[i])}
            for i, n in enumerate(names)
        },
        "max_abs_diff_sharded_vs_unsharded_bf16": {
            n: max_diff(got[i], plain[i]) for i, n in enumerate(names)
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", default="simulated,nccl,bf16,speed")
    ap.add_argument("--device", default="cuda", help="cpu dry-runs the sections (no NCCL)")
    ap.add_argument("--small", action="store_true", help="only the small speed configuration")
    ap.add_argument("--backends", default="eager", help="ours' backends to time, e.g. eager,inductor")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs a CUDA GPU (torch.cuda.is_available() is False).")
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "none (cpu dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    backends = tuple(args.backends.split(","))
    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "simulated": section_simulated,
        "nccl": section_nccl,
        "bf16": section_bf16,
        "speed": lambda: {
            "small (4 layers, d 256)": section_speed(
                gpt.Config(vocab=256, seq=128, d=256, heads=4, layers=4), 8, args.rounds, args.steps, backends
            ),
            **(
                {}
                if args.small
                else {
                    "medium (8 layers, d 1024)": section_speed(
                        gpt.Config(vocab=8192, seq=512, d=1024, heads=16, layers=8),
                        8,
                        args.rounds,
                        args.steps,
                        backends,
                    )
                }
            ),
        },
    }
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = sections[name]()
        except Exception as e:  # one section's failure is recorded, the rest still run
            report[name] = {
                "error": f"{type(e).__name__}: {e}"[:4000],
                "traceback": traceback.format_exc()[-6000:],
            }
        report[name + "_s"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(report[name], indent=1, default=str)[:6000], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
