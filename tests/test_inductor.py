"""sharded(backend="inductor"): the compiled per-rank programs compute what the eager ones compute.

Inductor compiles a tiny step in tens of seconds on two cores, so the cases are few and small: the
MLP step under DP, Megatron TP and ZeRO-3 on simulated meshes (two steps, the second from the first's
results), one uneven mesh (one compile per distinct program), a donated step, a 1F1B pipeline, the
counter-based random ops, the eager fallback of a region that cannot be compiled, and DP on two gloo
processes against one process.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from compiler import inductor
from examples.models import mlp
from shardspec import Mesh, P, ShardingError, optim, sharded
from shardspec.testing import run_distributed
from tests.mlp_strategies import batch

FALLBACK = r"sharded\(backend='inductor'\)"  # the warning of a region left to run eagerly
# fused loops round differently from op-by-op kernels: equal up to float32 rounding
TOL = {"rtol": 1e-4, "atol": 1e-5}

SPECS = {
    "dp": ({"dp": 2}, {"w1": P(), "b1": P(), "w2": P()}, P("dp")),
    "megatron": ({"tp": 2}, {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}, P()),
    "zero3": ({"dp": 2}, {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}, P("dp")),
}


def _steps(axes, pspec, bspec, backend, n=2, donate=(), simulate=True):
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    f = sharded(
        mlp.make_step(opt),
        mesh=Mesh(axes, simulate=simulate),
        in_specs=(pspec, opt.state_specs(pspec), bspec, bspec),
        out_specs=(pspec, opt.state_specs(pspec), P()),
        backend=backend,
        donate=donate,
    )
    params = mlp.init(8, 16, 4)
    state = opt.init(params)
    losses = []
    for i in range(n):
        params, state, loss = f(params, state, *batch(i))
        losses.append(loss)
    return f, params, state, losses


def _assert_same(a, b):
    for got, want in zip(a[1:], b[1:], strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("strategy", ["dp", "megatron", "zero3"])
def test_inductor_equals_eager_on_a_simulated_mesh(strategy):
    axes, pspec, bspec = SPECS[strategy]
    eager = _steps(axes, pspec, bspec, "eager")
    compiled = _steps(axes, pspec, bspec, "inductor")
    _assert_same(compiled, eager)
    program = compiled[0]._program((compiled[1], compiled[2], *batch(0)))[0]
    driver = inductor._COMPILED[program.programs[0]].driver
    assert any(isinstance(m, inductor._Compiled) for m in driver.children())  # it did compile
    # the collectives run as the eager program runs them, in the same order
    assert _collectives(driver) == _collectives(program.programs[0])


def _collectives(gm):
    return [
        (str(n.target), sorted(n.kwargs.items()))
        for n in gm.graph.nodes
        if n.op == "call_function"
        and getattr(n.target, "namespace", "") == "shardspec"
        and getattr(n.target, "_opname", "") in inductor._CUT_OPS
    ]


def test_each_distinct_program_compiles_once(monkeypatch):
    calls = []
    real = inductor._build
    monkeypatch.setattr(inductor, "_build", lambda gm, *a: calls.append(gm) or real(gm, *a))
    pspec = {"w1": P(), "b1": P(), "w2": P("dp")}  # w2's 16 rows over 3 ranks: blocks of 6, 6, 4
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FALLBACK)  # every region compiles, uneven shapes included
        f, params, state, _ = _steps({"dp": 3}, pspec, P(), "inductor", n=3)
    program = f._program((params, state, *batch(0)))[0]
    distinct = {id(p) for p in program.programs}
    assert len(calls) == len(distinct) and {id(gm) for gm in calls} == distinct  # once each, 3 calls
    eager = _steps({"dp": 3}, pspec, P(), "eager", n=3)
    _assert_same((f, params, state, _), eager)


def test_donated_step_equals_eager():
    axes, pspec, bspec = SPECS["zero3"]
    _assert_same(
        _steps(axes, pspec, bspec, "inductor", donate=(0, 1)),
        _steps(axes, pspec, bspec, "eager", donate=(0, 1)),
    )


def test_a_region_inductor_cannot_compile_runs_eagerly_with_one_warning(monkeypatch):
    def refuse(self, gm, vals):
        raise RuntimeError("no lowering for this op\n(internal details)")

    monkeypatch.setattr(inductor._Region, "compile", refuse)
    axes, pspec, bspec = SPECS["dp"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _steps(axes, pspec, bspec, "inductor")
    ours = [w for w in seen if "backend='inductor'" in str(w.message)]
    assert len(ours) == 1
    assert "run eagerly" in str(ours[0].message) and "no lowering for this op" in str(ours[0].message)
    assert "internal details" not in str(ours[0].message)
    _assert_same(got, _steps(axes, pspec, bspec, "eager"))


def test_bad_backend_names_the_allowed_values():
    with pytest.raises(ShardingError, match=r"(?s)backend='cuda'.*'eager', 'inductor'"):
        sharded(lambda x: x, mesh=Mesh({"dp": 2}, simulate=True), in_specs=P(), out_specs=P(), backend="cuda")


def _train_dp(rank, world, backend):
    _, params, _, losses = _steps({"dp": world}, SPECS["dp"][1], P("dp"), backend, simulate=False)
    # ranks calling different steps, each on its first (recording) call: the agreement check
    # raises inside the program's first collective, and its message stays as written
    mesh = Mesh({"dp": world})
    other = [
        sharded(fn, mesh=mesh, in_specs=(P("dp"),), out_specs=P(), backend=backend, check_values=False)
        for fn in (lambda x: (x * 2).sum(0), lambda x: (x + 1).sum(0))
    ][rank % 2]
    try:
        other(torch.ones(4, 3))
        refused = ""
    except ShardingError as exc:
        refused = str(exc)
    return {
        "losses": [x.full_tensor() for x in losses],
        "params": {k: v.full_tensor() for k, v in params.items()},
        "refused": refused,
    }


@pytest.mark.multiprocess
def test_inductor_on_two_gloo_processes_matches_one_process():
    want = _steps({"dp": 1}, SPECS["dp"][1], P("dp"), "eager")
    for r in run_distributed(_train_dp, 2, args=("inductor",), timeout=600):
        for got, ref in zip(r["losses"], want[3], strict=True):
            torch.testing.assert_close(got, ref, **TOL)
        for k, v in want[1].items():
            torch.testing.assert_close(r["params"][k], v, **TOL)
        assert "ranks compiled different programs" in r["refused"], r["refused"]  # (one line: one name)
        assert r["refused"].rstrip().splitlines()[-1].startswith("Fix:"), r["refused"]  # no graph dump


def test_pipelined_step_equals_eager():
    from benchmarks import pipeline_model as pm
    from shardspec import Pipeline

    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    params = pm.init(2, 8, 16, 4)
    x, y = pm.data(8, 8, 4)
    step = pm.make_step(2, opt)
    ps, ss, xs, ys = pm.specs(params, False, False, opt)

    def run(backend):
        f = sharded(
            step,
            mesh=Mesh({"pp": 2}, simulate=True),
            in_specs=(ps, ss, xs, ys),
            out_specs=(ps, ss, P()),
            pipeline=Pipeline("pp", "1f1b"),
            backend=backend,
        )
        got = f(params, opt.init(params), x, y)
        return f, f(*got[:2], x, y)  # a second step from the first's results

    f, got = run("inductor")
    _, want = run("eager")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    program = f._program((params, opt.init(params), x, y))[0]
    assert all(inductor._COMPILED[gm].driver is not None for gm in program.programs)  # each stage's


def _draws(x, key):
    import torch.nn.functional as F

    import shardspec

    with shardspec.random.rng(key):
        return {"dropout": F.dropout(x, 0.3), "rand": torch.rand(x.shape), "randn_like": torch.randn_like(x)}


def test_counter_based_random_ops_compile_and_draw_the_same_bits():
    import shardspec

    x, key = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), shardspec.random.key(7)
    want = _draws(x, key)  # eager, unsharded
    mesh = Mesh({"dp": 2}, simulate=True)
    f = sharded(_draws, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P(None, "dp"), backend="inductor")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FALLBACK)  # compiled, not left to run eagerly
        for _ in range(2):  # the recording first call, then the compiled program
            got = f(x, key)
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=0)
    program = f._program((x, key))[0]
    assert any(
        isinstance(m, inductor._Compiled) for m in inductor._COMPILED[program.programs[0]].driver.children()
    )


def test_a_region_with_a_constant_is_not_reused_for_another_constant():
    """Compiled regions are shared by what they compute; a tensor constant (a Python value the
    step turned into a tensor) was baked into the code by its attribute name, so a program with
    another value reused it: a changed hyperparameter silently kept its old value."""
    mesh = Mesh({"dp": 2}, simulate=True)

    def f(x, s):
        return ((x * torch.tensor(s)).sin() + 1.0).cos() * 2.0

    g = sharded(f, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"), backend="inductor")
    x = torch.randn(4, 3)
    for s in (0.5, 0.5, 2.0, 2.0):  # each value's second call runs the compiled code
        torch.testing.assert_close(g(x, s), f(x, s))


def test_sequence_parallel_layer_norms_compile_too():
    """A layer norm's getitems fell on both sides of a sequence-parallel collective: the run
    returned the op's tuple, which Inductor cannot, and those regions ran eagerly (with a
    warning). Each getitem now runs in its op's region."""
    from examples.models import gpt
    from examples.train_gpt import OPT, batch, make_step, state_specs, strategy_specs

    axes = {"tp": 2}
    cfg = gpt.Config(layers=1, vocab=32, seq=8, d=16, heads=2, residual=P(None, "tp"))
    params = gpt.init(cfg)
    ps = strategy_specs("tp-sp", params, axes)
    ss = state_specs("tp-sp", ps, axes)
    step = make_step(cfg)
    run = sharded(
        step,
        mesh=Mesh(axes, simulate=True),
        in_specs=(ps, ss, P(), P()),
        out_specs=(ps, ss, P()),
        backend="inductor",
    )
    tok, tgt = batch(0, cfg)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*region\\(s\\) of the per-rank program run eagerly")
        for _ in range(2):  # the second call runs the compiled program
            got = run(params, OPT.init(params), tok, tgt)
    want = step(params, OPT.init(params), tok, tgt)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-5, atol=1e-6)
