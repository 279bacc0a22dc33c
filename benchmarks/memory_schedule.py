"""The schedule's memory choices, predicted by ``cost()`` (docs/memory.md's last tables): bytes sent
against ``sharded(memory_budget=...)`` for ZeRO-3, and ZeRO-3's peak as the mesh grows on a
configuration whose model states dominate."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import shardspec
from examples.models import gpt
from shardspec import Mesh, P, sharded

SMALL_BUCKETS = {"zero_bucket_bytes": 2**16}  # about a weight per gather: each re-gather frees one


def _step(cfg: gpt.Config, opt: Any, remat: bool) -> Any:
    """The GPT training step for ``cfg`` (fp32 AdamW ``opt``), its blocks under remat or not."""
    block = shardspec.remat(gpt.block) if remat else gpt.block

    def loss_fn(p: dict[str, torch.Tensor], tok: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tok, p["wte"]) + p["wpe"][: tok.shape[1]]
        for i in range(cfg.layers):
            x = block(p, f"h.{i}.", x, cfg.heads)
        x = F.layer_norm(x, (cfg.d,), p["ln_f.weight"], p["ln_f.bias"])
        return F.cross_entropy(F.linear(x, p["head.weight"]).reshape(-1, cfg.vocab), tgt.reshape(-1))

    def step(p: Any, s: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
        loss, g = shardspec.value_and_grad(loss_fn)(p, tok, tgt)
        p, s = opt.update(g, s, p)
        return p, s, loss

    return step


def _zero3_cost(cfg: gpt.Config, opt: Any, n: int, rows: int, remat: bool = False, **kw: Any) -> Any:
    params = gpt.init(cfg)
    split = {k: P("dp") for k in params}
    f = sharded(
        _step(cfg, opt, remat),
        mesh=Mesh({"dp": n}, simulate=True),
        in_specs=(split, opt.state_specs(split), P("dp"), P("dp")),
        out_specs=(split, opt.state_specs(split), P()),
        donate=(0, 1),
        **kw,
    )
    tok = torch.randint(0, cfg.vocab, (rows * n, cfg.seq), generator=torch.Generator().manual_seed(0))
    return f.lower(params, opt.init(params), tok, tok).cost()


def budget_rows(cfg: gpt.Config, opt: Any, n: int, rows: int) -> list[tuple[str, int, Any]]:
    """(label, budget, cost) from the re-gather-everything peak up to the keep-everything one."""
    keep = _zero3_cost(cfg, opt, n, rows, passes={**SMALL_BUCKETS, "regather": False})
    again = _zero3_cost(cfg, opt, n, rows, passes=SMALL_BUCKETS)
    lo, hi = sorted((again.peak_memory_bytes_per_rank, keep.peak_memory_bytes_per_rank))
    out: list[tuple[str, int, Any]] = [("regather on (default)", 0, again), ("regather off", 0, keep)]
    for k in range(5):
        b = lo + (hi - lo) * k // 4
        out.append(
            (
                f"memory_budget = lowest + {k}/4 of the range",
                b,
                _zero3_cost(cfg, opt, n, rows, passes=SMALL_BUCKETS, memory_budget=b),
            )
        )
    return out


def peak_with_n(opt: Any) -> dict[int, int]:
    """ZeRO-3 peaks at N = 2, 4, 8 where model states dominate (tests/test_memory.py's config)."""
    cfg = gpt.Config(vocab=64, seq=8, d=256, heads=4, layers=4)
    return {
        n: _zero3_cost(
            cfg, opt, n, 1, remat=True, passes={"zero_bucket_bytes": 2**18}
        ).peak_memory_bytes_per_rank
        for n in (2, 4, 8)
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def render(budget: list[tuple[str, int, Any]], peaks: dict[int, int], n: int) -> list[str]:
    lines = [
        "## Memory budget: re-gather or keep, per parameter",
        "",
        f"ZeRO-3 on {n} simulated devices (the GPT above, fp32 AdamW, donated, parameter-gather buckets"
        f" of {SMALL_BUCKETS['zero_bucket_bytes'] // 1024} KiB so a re-gather frees about one weight)."
        " Each budget row is `sharded(..., memory_budget=b)`: the fewest parameters gathered again for"
        " backward (the longest-held first) whose predicted peak is at most b. With the default buckets"
        " (1 MiB or more) re-gathering raises this small model's peak instead (a backward bucket holds"
        " several layers' weights unsharded at once); a budget then keeps every gather, which is both"
        " fewer bytes and less memory.",
        "",
        "| schedule | budget (MiB) | predicted peak (MiB) | bytes sent per rank (MiB) |",
        "|---|---|---|---|",
    ]
    for label, b, c in budget:
        lines.append(
            f"| {label} | {_mib(b) if b else '-'} | {_mib(c.peak_memory_bytes_per_rank)} |"
            f" {_mib(c.comm_bytes_per_rank)} |"
        )
    ratio = peaks[8] / peaks[2]
    lines += [
        "",
        "A budget below the lowest peak of any schedule is an error naming the budget, that peak and"
        " the fix (more devices, ZeRO-3 specs, donation, remat, a bigger budget).",
        "",
        "## ZeRO-3 peak against N where model states dominate",
        "",
        "GPT with d 256, 4 layers under remat, one sequence of 8 tokens per rank, fp32 AdamW, donated,"
        " 256 KiB gather buckets (`tests/test_memory.py`): predicted peak per rank "
        + ", ".join(f"N = {k}: {_mib(v)} MiB" for k, v in sorted(peaks.items()))
        + f"; peak(8) / peak(2) = {ratio:.2f} ({'at most' if ratio <= 0.35 else 'above'} the 0.35 target)."
        f" On the table's GPT (activations about as large as the model states) the ratio is larger:"
        " see the ZeRO-3 rows above.",
    ]
    return lines


def acceptance(
    sim: list[Any],
    gloo: dict[int, list[dict[str, Any]]],
    versus: dict[str, dict[int, dict[str, dict[str, Any]]]],
    peaks: dict[int, int],
    formulas: dict[str, Any],
) -> list[str]:
    """The memory acceptance lines, each with the verdict the tables above give."""
    donated = [r for r in sim if r.donate]
    state_err = max(
        abs(r.model_state / r.psi - formulas[r.strategy](r.n)) / formulas[r.strategy](r.n) for r in donated
    )
    rows = [*sim, *(r for per_rank in gloo.values() for out in per_rank for r in out["rows"])]
    peak_err = max(abs(r.predicted - r.measured) / r.measured for r in rows)
    remat = {(r.strategy, r.n): r.activations for r in sim if r.remat}
    plain = {(r.strategy, r.n): r.activations for r in sim if not r.remat and r.donate}
    act_ratio = max(remat[k] / plain[k] for k in remat)
    ratio = peaks[8] / peaks[2]

    lines = [
        "## Acceptance, as measured here",
        "",
        f"- Model-state bytes within 5% of the ZeRO formulas with donation: {verdict(state_err <= 0.05)}"
        f" (largest deviation {state_err:.1%} over the {len(donated)} donated rows).",
        "- ZeRO-3 peak(N=8) at most 0.35x peak(N=2) on a model-state-dominated config:"
        f" {verdict(ratio <= 0.35)} ({ratio:.2f}; the table's activation-heavy GPT does not meet it:"
        " its ZeRO-3 rows show the activations and gathers that do not shrink with N).",
        f"- Peak measured within 5% of predicted on every row: {verdict(peak_err <= 0.05)}"
        f" (largest error {peak_err:.1%} over {len(rows)} simulated and gloo rows).",
        f"- Remat: activation peak of the 4-layer step at most one layer plus the checkpoints, results"
        f" unchanged: met by `tests/test_remat.py` (here the activation column falls to {act_ratio:.0%}"
        " of the plain step's on every row).",
    ]
    for model, per_world in versus.items():
        for world, cmp in sorted(per_world.items()):
            lines += _versus_lines(model, world, cmp)
    lines.append(
        "- Bad input (a donated argument returned unchanged, remat around a function with side"
        " effects, a memory budget no schedule meets): met, each an error naming the argument and the"
        " fix (`tests/test_donation.py`, `tests/test_remat.py`, `tests/test_memory_budget.py`)."
    )
    return lines


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _versus_lines(model: str, world: int, cmp: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for strategy, name in (("dp", "DDP"), ("zero3", "FSDP2")):
        o, t = cmp[strategy]["ours"], cmp[strategy]["torch"]
        lines.append(
            f"- Resident peak per rank at most {name}'s at world {world} ({strategy}, {model} model):"
            f" {verdict(o['peak'] <= t['peak'])} (held + step {o['peak'] / 2**20:.2f} MiB against"
            f" {t['peak'] / 2**20:.2f}; step growth alone {o['step'] / 2**20:.2f} against"
            f" {t['step'] / 2**20:.2f}, which {'is' if o['step'] <= t['step'] else 'is not'} at most"
            f" {name}'s)."
        )
    return lines
