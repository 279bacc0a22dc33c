"""The step's large intermediates at planned offsets of one buffer held between calls
(compiler/passes/arena.py): two values share elements only when never live at once, each starts
on a cache line, the program computes the same bits as without the arena, ``cost()`` still
predicts the measured peak, and on a real mesh the buffer is the same one every call."""

from __future__ import annotations

import optree
import pytest
import torch

import compiler.runtime as runtime
from compiler.passes.arena import ALIGN, ARENA
from compiler.passes.graph import alias_source, aliases_input
from examples.models import gpt
from shardspec import Mesh, P, sharded
from shardspec.testing import run_distributed
from tests.test_colocate import OPT, _step
from tests.test_memory import _measured_peak

CFG = gpt.Config(vocab=64, seq=32, d=64, heads=4, layers=2)


def _specs(strategy: str, params: dict[str, torch.Tensor]) -> dict[str, P]:
    if strategy == "zero3":
        return {k: P("dp") if v.shape[0] % 2 == 0 else P() for k, v in params.items()}
    return {k: P() for k in params}


def _make(strategy: str, mesh: Mesh, passes: dict[str, bool] | None = None):
    params = gpt.init(CFG)
    rep = _specs(strategy, params)
    return sharded(
        _step(CFG),
        mesh=mesh,
        in_specs=(rep, OPT.state_specs(rep), P("dp"), P("dp")),
        out_specs=(rep, OPT.state_specs(rep), P()),
        donate=(0, 1),
        passes=passes,
    )


def _run(f, steps: int = 3) -> list[torch.Tensor]:
    params = gpt.init(CFG)
    tok = torch.randint(0, CFG.vocab, (steps, 4, CFG.seq), generator=torch.Generator().manual_seed(1))
    p, s, out = optree.tree_map(torch.clone, params), OPT.init(params), []
    for i in range(steps):
        p, s, loss = f(p, s, tok[i], tok[i].roll(1, 1))
        out.append(loss)
    leaves = optree.tree_leaves((p, s, out))
    return [x.full_tensor() if hasattr(x, "full_tensor") else x for x in leaves]


def _placed(gm: torch.fx.GraphModule) -> list[tuple[int, int, int, int]]:
    """(start, end, made, last read) of every value computed into the arena; a value's reads are
    its own and those of the views made of it."""
    nodes = list(gm.graph.nodes)
    (arena,) = [n for n in nodes if n.meta.get(ARENA)]
    pos = {n: i for i, n in enumerate(nodes)}
    out = []
    for part in arena.users:
        (view,) = part.users
        (write,) = [u for u in view.users if u.kwargs.get("out") is view]
        seen, todo, last = {write}, [write], pos[write]
        while todo:
            for u in todo.pop().users:
                last = max(last, pos[u])
                if aliases_input(u) and alias_source(u) in seen and u not in seen:
                    seen.add(u)
                    todo.append(u)
        out.append((int(part.args[2]), int(part.args[3]), pos[write], last))
    return out


@pytest.mark.parametrize(
    ("strategy", "passes"),
    [("dp", {"pack_early": False}), ("dp", {"bucket": False})],
    ids=["dp, gradients packed late", "dp, unbucketed"],
)
def test_arena_values_never_share_elements_while_live_and_compute_the_same_bits(
    monkeypatch, strategy, passes
):
    """(DP's bucket, filled from the first gradient on, takes the large values itself: with
    ``pack_early`` or ``bucket`` off there is no such bucket.)"""
    mesh = Mesh({"dp": 2}, simulate=True)
    want = _run(_make(strategy, mesh, passes))
    compile_program = runtime.compile_program  # as a real mesh's eager runtime compiles
    monkeypatch.setattr(
        runtime, "compile_program", lambda *a, **k: compile_program(*a, **{**k, "held_buckets": True})
    )
    held = _make(strategy, mesh, passes)
    for a, b in zip(_run(held), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    params = gpt.init(CFG)
    args = (
        params,
        OPT.init(params),
        torch.zeros(4, CFG.seq, dtype=torch.long),
        torch.zeros(4, CFG.seq, dtype=torch.long),
    )
    placed = _placed(held.lower(*args).program.programs[0])
    assert len(placed) >= 4
    for i, (a, b, made, last) in enumerate(placed):
        assert (a * 4) % ALIGN == 0
        for c, d, made2, last2 in placed[i + 1 :]:
            if a < d and c < b:
                assert last < made2 or last2 < made
    predicted = held.lower(*args).cost().peak_memory_bytes_per_rank
    assert abs(predicted - _measured_peak(held, args)) <= 0.05 * predicted


def _real(rank: int, world: int) -> dict[str, object]:
    mesh = Mesh({"dp": world})
    on = _make("dp", mesh, {"pack_early": False})
    off = _make("dp", mesh, {"pack_early": False, "arena": False})
    got, want = _run(on, 2), _run(off, 2)
    (plan,) = on._plans.values()
    arenas = [getattr(plan.held, n.target) for n in plan.held.graph.nodes if n.meta.get(ARENA)]
    first = [m.held[0].data_ptr() for m in arenas]
    _run(on, 1)
    return {
        "same": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
        "held": len(arenas) == 1 and first == [m.held[0].data_ptr() for m in arenas],
    }


@pytest.mark.multiprocess
def test_on_a_real_mesh_the_arena_is_held_and_results_match_without_it():
    for r in run_distributed(_real, 2, timeout=180):
        assert r["same"] and r["held"], r


def test_zero_strategies_that_scatter_gradients_get_no_arena(monkeypatch):
    """ZeRO-2/3 split state to hold less between calls; an arena would hold a step's worth."""
    compile_program = runtime.compile_program
    monkeypatch.setattr(
        runtime, "compile_program", lambda *a, **k: compile_program(*a, **{**k, "held_buckets": True})
    )
    params = gpt.init(CFG)
    f = _make("zero3", Mesh({"dp": 2}, simulate=True))
    tok = torch.zeros(4, CFG.seq, dtype=torch.long)
    gm = f.lower(params, OPT.init(params), tok, tok).program.programs[0]
    assert not any(n.meta.get(ARENA) for n in gm.graph.nodes)
