"""Memory per rank of the example GPT under DP, ZeRO-1, ZeRO-2 and ZeRO-3, with and without remat
and donation: model-state bytes against ZeRO's formulas, and the peak ``cost()`` predicts against
the peak measured while the step runs; then DP and ZeRO-3 on gloo against DDP and FSDP2
(resident memory, ``benchmarks/memory_rss.py``).

    python -m benchmarks.memory_table            # writes docs/memory.md (several minutes)
    python -m benchmarks.memory_table --quick    # one row per part, printed (the CI smoke test)

Measured peak: the largest sum of bytes of the storages some tensor still references, taken after
every op of one rank's program by a TorchDispatchMode (``LiveStorage``): on a simulated mesh for
rank 0 (dispatch modes are per thread), on gloo in each process.
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import shardspec
from benchmarks import memory_rss as rss
from benchmarks import memory_schedule as ms
from collectives.simulated import run_simulated
from examples.models import gpt
from shardspec import Mesh, P, constrain, optim, sharded
from shardspec.layout import device_slices, shard

CFG = gpt.Config(vocab=128, seq=32, d=128, heads=4, layers=4)
ROWS_PER_RANK = 2
OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
# the resident-memory comparison with DDP and FSDP2: this table's model, and the GPT of
# benchmarks/compare.py, whose model states outweigh the compiled program's fixed cost
RSS_MODELS = {
    "small": (CFG, ROWS_PER_RANK),
    "d256": (gpt.Config(vocab=256, seq=128, d=256, heads=4, layers=4), 2),
}


def _describe(model: str) -> str:
    cfg, rows = RSS_MODELS[model]
    return f"vocab {cfg.vocab}, seq {cfg.seq}, d {cfg.d}, {cfg.layers} layers, {rows} sequences per rank"


BF16 = torch.bfloat16
STRATEGIES = ("dp", "zero1", "zero2", "zero3")
FORMULAS: dict[str, Callable[[int], float]] = {  # bytes per parameter, K = 12 (ZeRO paper, mixed precision)
    "dp": lambda n: 16.0,
    "zero1": lambda n: 4 + 12 / n,
    "zero2": lambda n: 2 + 14 / n,
    "zero3": lambda n: 16 / n,
}
FORMULA_TEXT = {"dp": "16Ψ", "zero1": "4Ψ + 12Ψ/N", "zero2": "2Ψ + 14Ψ/N", "zero3": "16Ψ/N"}


class LiveStorage(TorchDispatchMode):  # type: ignore[misc]
    """Bytes of the storages that some tensor still references, after each op of one thread."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[int, tuple[int, list[weakref.ref[torch.Tensor]]]] = {}
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self.buffers.get(key)
        if entry is None or not any(r() is not None for r in entry[1]):  # new, or an address reused
            entry = self.buffers[key] = (storage.nbytes(), [])
        entry[1].append(weakref.ref(t))

    def live(self) -> int:
        return sum(n for n, refs in self.buffers.values() if any(r() is not None for r in refs))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                self.add(t)
        self.peak = max(self.peak, self.live())
        return out


def run_tracked(gm: Any, local: list[torch.Tensor]) -> int:
    """Run one rank's program on its local inputs; the peak of live storage (inputs included)."""
    tracker = LiveStorage()
    for t in local:
        tracker.add(t)
    tracker.peak = tracker.live()
    with torch.no_grad(), tracker:
        gm(*local)
    return tracker.peak


@dataclass(frozen=True)
class Row:
    strategy: str
    n: int
    remat: bool
    donate: bool
    psi: int = 0
    model_state: int = 0
    predicted: int = 0
    measured: int = 0
    activations: int = 0


def _loss(remat: bool) -> Callable[..., torch.Tensor]:
    block = shardspec.remat(gpt.block) if remat else gpt.block

    def loss_fn(p: dict[str, torch.Tensor], tok: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tok, p["wte"]) + p["wpe"][: tok.shape[1]]
        for i in range(CFG.layers):
            x = block(p, f"h.{i}.", x, CFG.heads)
        x = F.layer_norm(x, (CFG.d,), p["ln_f.weight"], p["ln_f.bias"])
        logits = F.linear(x, p["head.weight"]).float()
        return F.cross_entropy(logits.reshape(-1, CFG.vocab), tgt.reshape(-1))

    return loss_fn


def mixed_zero_step(grad_specs: dict[str, P], remat: bool) -> Callable[..., Any]:
    """ZeRO as the paper counts it, written as a step: bf16 parameters (compute copy) and fp32
    master + AdamW moments carried; bf16 gradients laid out by ``grad_specs`` (P(): all-reduced,
    ZeRO-1; P("dp"): reduce-scattered, ZeRO-2/3); the updated master cast back to bf16."""
    loss_fn = _loss(remat)

    def step(p16: Any, master: Any, s: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
        loss, g = shardspec.value_and_grad(loss_fn)(p16, tok, tgt)
        g = {k: constrain(v, grad_specs[k]).float() for k, v in g.items()}
        master, s = OPT.update(g, s, master)
        return {k: v.to(BF16) for k, v in master.items()}, master, s, loss

    return step


def layouts(strategy: str, params: dict[str, torch.Tensor]) -> tuple[dict[str, P], ...]:
    """(bf16 parameter, fp32 master and moment, gradient) specs of each strategy."""
    rep, split = {k: P() for k in params}, {k: P("dp") for k in params}
    return {
        "dp": (rep, rep, rep),
        "zero1": (rep, split, rep),
        "zero2": (rep, split, split),
        "zero3": (split, split, split),
    }[strategy]


def build(row: Row, mesh: Mesh) -> tuple[Any, tuple[Any, ...]]:
    params = gpt.init(CFG)
    p16s, ms, gs = layouts(row.strategy, params)
    f = sharded(
        mixed_zero_step(gs, row.remat),
        mesh=mesh,
        in_specs=(p16s, ms, OPT.state_specs(ms), P("dp"), P("dp")),
        out_specs=(p16s, ms, OPT.state_specs(ms), P()),
        donate=(0, 1, 2) if row.donate else (),
    )
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, CFG.vocab, (ROWS_PER_RANK * mesh.size, CFG.seq), generator=g)
    p16 = {k: v.to(BF16) for k, v in params.items()}
    return f, (p16, params, OPT.init(params), tok, tok)


def _planned(row: Row, f: Any, args: tuple[Any, ...], rank: int) -> Row:
    low = f.lower(*args)
    cost = low.cost()
    psi = sum(v.numel() for v in args[1].values())
    return replace(
        row,
        psi=psi,
        model_state=cost.model_state_bytes_per_rank,
        predicted=low.peak_memory(rank),
        activations=cost.activation_peak_bytes_per_rank,
    )


def simulated_row(row: Row) -> Row:
    f, args = build(row, Mesh({"dp": row.n}, simulate=True))
    row = _planned(row, f, args, 0)
    program = f._program(args)[0]
    leaves = optree.tree_leaves(args, none_is_leaf=False)
    tensors = [leaves[i] for i in program.traced.tensor_positions]
    pieces = [shard(t, program.mesh, s) for t, s in zip(tensors, program.in_specs, strict=True)]
    peak: dict[int, int] = {}

    def body(rank: int) -> None:
        local = [p[rank] for p in pieces]
        if rank == 0:
            peak[0] = run_tracked(program.programs[0], local)
        else:
            with torch.no_grad():
                program.programs[rank](*local)

    run_simulated(body, program.mesh)
    return replace(row, measured=peak[0])


def _local(program: Any, tensors: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    return [
        t[device_slices(tuple(t.shape), program.mesh, s, rank)].clone()  # own storage, as a DTensor's
        for t, s in zip(tensors, program.in_specs, strict=True)
    ]


def gloo_rows(rank: int, world: int, rows: list[Row]) -> list[Row]:
    """Each row's program run on this gloo process under the tracker (called by run_distributed)."""
    torch.manual_seed(0)
    mesh = Mesh({"dp": world})
    out = []
    for row in rows:
        f, args = build(replace(row, n=world), mesh)
        planned = _planned(replace(row, n=world), f, args, rank)
        program = f._program(args)[0]
        leaves = optree.tree_leaves(args, none_is_leaf=False)
        local = _local(program, [leaves[i] for i in program.traced.tensor_positions], rank)
        with torch.no_grad():
            program.programs[rank](*[t.clone() for t in local])  # warm-up: first-call allocations
        out.append(replace(planned, measured=run_tracked(program.programs[rank], local)))
    return out


def fp32_step(remat: bool) -> Callable[..., Any]:
    loss_fn = _loss(remat)

    def step(p: Any, s: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(loss_fn)(p, tok, tgt)
        p, s = OPT.update(grads, s, p)
        return p, s, loss

    return step


def _gloo(rank: int, world: int, rows: list[Row]) -> dict[str, Any]:
    return {"rows": gloo_rows(rank, world, rows)}


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def render(
    sim: list[Row],
    gloo: dict[int, list[dict[str, Any]]],
    versus: dict[str, dict[int, dict[str, dict[str, Any]]]] | None = None,
    load: str = "",
    schedule: list[str] | None = None,
) -> str:
    psi = sim[0].psi
    lines = [
        "# Memory per rank",
        "",
        "Generated by `python -m benchmarks.memory_table` (do not edit by hand). Model: the example",
        f"GPT of `examples/models/gpt.py` (vocab {CFG.vocab}, seq {CFG.seq}, d {CFG.d}, {CFG.layers}"
        f" layers, Ψ = {psi:,} parameters), {ROWS_PER_RANK} sequences per rank, AdamW.",
        "",
        "## Model states against ZeRO's formulas",
        "",
        "The step is ZeRO as the paper counts it (K = 12), written as a user would: bf16 parameters"
        " (2 bytes) and fp32 master parameters and AdamW moments (12 bytes) are carried; gradients are"
        ' bf16 (2 bytes), constrained to `P()` (all-reduced: ZeRO-1) or `P("dp")` (reduce-scattered:'
        " ZeRO-2, ZeRO-3); the update runs on the master's layout and its result is cast back to bf16.",
        "Per rank, with N devices:",
        "",
        "| strategy | bf16 params | bf16 grads | fp32 master + m + v | formula |",
        "|---|---|---|---|---|",
        "| DP | 2Ψ | 2Ψ | 12Ψ | 16Ψ |",
        "| ZeRO-1 | 2Ψ | 2Ψ | 12Ψ/N | 4Ψ + 12Ψ/N |",
        "| ZeRO-2 | 2Ψ | 2Ψ/N | 12Ψ/N | 2Ψ + 14Ψ/N |",
        "| ZeRO-3 | 2Ψ/N | 2Ψ/N | 12Ψ/N | 16Ψ/N |",
        "",
        "`cost().model_state_bytes_per_rank` counts the carried arguments (parameters, master, moments)"
        " at their layouts, each gradient at the layout the update reads it, and casts of carried"
        " arguments at the layout they are held in. In plain fp32 (4 bytes each for parameters,"
        " gradients and both moments) the same count gives 16Ψ (DP), 4Ψ + 12Ψ/N (a replicated"
        " parameter with sharded state: its gradient is reduce-scattered, since the update reads only"
        " the state's shard) and 16Ψ/N (ZeRO-3); see `tests/test_memory.py`.",
        "",
        "Peak: `cost().peak_memory_bytes_per_rank`, liveness over the scheduled program (after every"
        " pass: views free, an async all-gather's or reduce-scatter's input held until its wait (an"
        " all-reduce copies its input at launch), buffers freed at last use), against"
        " the peak of live storage measured op by op while rank 0 runs the program on a simulated mesh.",
        "Activations: `cost().activation_peak_bytes_per_rank`, the largest live sum of values computed"
        " in forward from the batch (and their recomputations).",
        "",
        "| strategy | N | remat | donate | model state (B/param) | formula | predicted peak (MiB) |"
        " measured peak (MiB) | error | activations (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sim:
        err = (r.predicted - r.measured) / r.measured
        lines.append(
            f"| {r.strategy} | {r.n} | {'yes' if r.remat else 'no'} | {'yes' if r.donate else 'no'} | "
            f"{r.model_state / r.psi:.2f} | {FORMULAS[r.strategy](r.n):.2f} ({FORMULA_TEXT[r.strategy]}) | "
            f"{_mib(r.predicted)} | {_mib(r.measured)} | {err:+.1%} | {_mib(r.activations)} |"
        )
    lines += [
        "",
        "## On gloo",
        "",
        "The same programs run by real processes (`shardspec.testing.run_distributed`, gloo), each"
        " rank's peak of live storage measured by the same dispatch-mode tracker, against the peak"
        " `cost()` predicts for that rank. World 4 runs 4 processes on 2 CPU cores (oversubscribed:"
        " the bytes are the same, only the timing suffers).",
        "",
        "| world | strategy | remat | donate | predicted peak (MiB) |"
        " measured peak (MiB), rank 0 / last | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, per_rank in sorted(gloo.items()):
        for i, r0 in enumerate(per_rank[0]["rows"]):
            rl = per_rank[-1]["rows"][i]
            err = max(abs(r.predicted - r.measured) / r.measured for r in (r0, rl))
            lines.append(
                f"| {world} | {r0.strategy} | {'yes' if r0.remat else 'no'} | "
                f"{'yes' if r0.donate else 'no'} | {_mib(r0.predicted)} | {_mib(r0.measured)} / "
                f"{_mib(rl.measured)} | {err:.1%} |"
            )
    for model, per_world in (versus or {}).items():
        lines += ["", *rss.render(per_world, load, _describe(model))]
    if schedule:
        lines += ["", *schedule]
    lines += [
        "",
        "## Reading the tables",
        "",
        "- Model states equal the formulas on every row (the count is exact; the formulas ignore the"
        " step counter). Peaks are larger: they add activations, gathered parameters in flight and,"
        " without donation, the new parameters and moments written beside the old ones.",
        "- DP and ZeRO-1 peak at the update, so donation lowers them and remat does not (it lowers the"
        " activation column); ZeRO-2 and ZeRO-3 peak in backward, where remat helps too.",
        "- Against torch the comparison is of resident memory, allocator included: the last column"
        " says whether our peak (held + step) is at most the torch side's.",
        "- Our `held` above `state` is mostly what tracing and compiling the step leaves in the"
        " process: a cost per process that grows with the program's length, not with the model's"
        " width. On the small model it outweighs what ZeRO-3 saves; on the d 256 GPT ZeRO-3 ends at"
        " or below FSDP2. Of it, the Python objects the compiled step still references are about"
        " 8 MiB on the d 256 GPT (fake values and fx graphs, by tracemalloc), and dropping every"
        " node's fake value gives back 0.1 MiB of resident memory: the rest is heap pages that the"
        " compile's transient objects left partly used, which neither Python's allocator nor glibc's"
        " returns to the system.",
        "- DP against DDP: DDP keeps its `.grad` tensors between steps and frees them when the next"
        " step begins, so that step's activations take their memory (its `held` counts them)."
        " Our gradient bucket is held between calls on a real mesh as DDP holds"
        " its buckets (`compiler/passes/held.py`; allocated afresh, the freed 12.7 MB bucket raised"
        " glibc's mmap threshold, after which the heap fragmented), filled from the first gradient"
        " on, weight gradients computed straight into it (`mm.out`), and the forward and backward"
        " values that die before part of it is written are computed into that part"
        " (`compiler/passes/colocate.py`): the next layers' activations live where the first"
        " layers' gradients will go. Its `predicted` counts the bucket from the start of the step,"
        " as it is resident then. A fixed 128 KiB mmap threshold (`MALLOC_MMAP_THRESHOLD_=131072`,"
        " both sides) is not set: it page-faults every large tensor anew each step.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one row per part, printed, nothing written")
    ap.add_argument("--rss-worlds", default="2,4", help="world sizes of the comparison with torch")
    ap.add_argument("--rss-models", default=",".join(RSS_MODELS), help="models of the comparison with torch")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "memory.md"))
    a = ap.parse_args(argv)
    from shardspec.testing import run_distributed

    if a.quick:
        sim_rows = [Row("zero3", 2, True, True)]
        gloo_plan = {2: [Row("zero3", 2, False, True)]}
    else:
        sim_rows = [
            Row(s, n, remat, donate)
            for s in STRATEGIES
            for n in (2, 4, 8)
            for remat, donate in ((False, False), (False, True), (True, True))
        ]
        gloo_rows_ = [Row(s, 0, remat, True) for s in STRATEGIES for remat in (False, True)]
        gloo_plan = {2: gloo_rows_, 4: [Row(s, 0, False, True) for s in STRATEGIES]}
    sim = []
    for row in sim_rows:
        sim.append(simulated_row(row))
        print(sim[-1], file=sys.stderr)
    gloo = {}
    for world, rows in gloo_plan.items():
        gloo[world] = run_distributed(_gloo, world, args=(rows,), timeout=900)
        print(world, gloo[world][0], file=sys.stderr)
    versus: dict[str, dict[int, Any]] = {}
    for model in [] if a.quick else [m for m in a.rss_models.split(",") if m]:
        cfg, rows_per_rank = RSS_MODELS[model]
        for world in [int(w) for w in a.rss_worlds.split(",") if w]:
            versus.setdefault(model, {})[world] = rss.versus_torch(world, cfg, rows_per_rank)
            print(model, world, versus[model][world], file=sys.stderr)
    schedule = []
    if not a.quick:
        budget, peaks = ms.budget_rows(CFG, OPT, 4, ROWS_PER_RANK), ms.peak_with_n(OPT)
        schedule = [*ms.render(budget, peaks, 4), "", *ms.acceptance(sim, gloo, versus, peaks, FORMULAS)]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = render(sim, gloo, versus, load, schedule)
    if a.quick:
        print(text)
        return
    with open(a.out, "w") as fh:
        fh.write(text)
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
