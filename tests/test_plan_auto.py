"""``shardspec.AUTO``: the planner chooses the layout of parameters and optimizer state too.

MLP 32-64-8 + AdamW, batch 64 over dp = 4, bytes-only machine (latency 0): the AUTO plan's modeled
step is at most the hand-written DP and ZeRO-3 plans'; under a memory limit DP exceeds, the chosen
layouts fit; results equal the unsharded step; explain() names every AUTO leaf's choice."""

from __future__ import annotations

import os

import optree
import pytest
import torch

import shardspec
from compiler.plan import modeled_time
from compiler.plan.auto import held_bytes
from compiler.sharding import Sharding
from examples.models import mlp
from shardspec import AUTO, CostModel, Mesh, P, ShardingError, optim, sharded

OPT = optim.adamw(lr=1e-2, weight_decay=0.0)
STEP = mlp.make_step(OPT)
MODEL = CostModel(latency_s=0.0)
MESH = Mesh({"dp": 4}, simulate=True)


def _args():
    torch.manual_seed(0)
    params = mlp.init(32, 64, 8)
    return params, OPT.init(params), torch.randn(64, 32), torch.randint(0, 8, (64,))


def _compile(pspec, sspec, model):
    args = _args()
    out_p = pspec
    f = sharded(
        STEP,
        mesh=MESH,
        in_specs=(pspec, sspec, P("dp"), P("dp")),
        out_specs=(out_p, sspec, P()),
        cost_model=model,
    )
    low = f.lower(*args)
    got, want = f(*args), STEP(*args)
    for a, b in zip(got[0].values(), want[0].values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    p = low.program
    return low, modeled_time(p.traced.module.graph, p.prop, p.mesh, MODEL).total_s


def _held(low):
    p = low.program
    return sum(
        held_bytes(tuple(t.shape), t.dtype.itemsize, Sharding.of(s, len(t.shape)), p.mesh)
        for s, t in zip(p.in_specs, p.traced.inputs, strict=True)
    )


REP = {"w1": P(), "b1": P(), "w2": P()}
ZERO3 = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}


def test_auto_is_no_slower_than_the_hand_written_strategies():
    auto, t_auto = _compile(AUTO, AUTO, MODEL)
    _, t_dp = _compile(REP, OPT.state_specs(REP), MODEL)
    _, t_zero3 = _compile(ZERO3, OPT.state_specs(ZERO3), MODEL)
    assert t_auto <= min(t_dp, t_zero3) * (1 + 1e-9)
    text = auto.explain()  # each AUTO leaf: its choice, modeled time and bytes, the next best
    for leaf in ("params['w1']", "params['b1']", "params['w2']"):
        assert f"AUTO {leaf}: chose" in text
    assert "next best" in text


def test_auto_under_a_memory_limit_dp_exceeds_picks_layouts_that_fit():
    dp, _ = _compile(REP, OPT.state_specs(REP), MODEL)
    limit = int(_held(dp) * 0.6)
    low, _ = _compile(AUTO, AUTO, CostModel(latency_s=0.0, memory_bytes=limit))
    assert _held(low) <= limit < _held(dp)


def test_a_memory_limit_nothing_fits_is_an_error_naming_it():
    with pytest.raises(ShardingError, match="memory_bytes=1000"):
        _compile(AUTO, AUTO, CostModel(latency_s=0.0, memory_bytes=1000))


@pytest.mark.slow
def test_gpt_with_every_parameter_auto_is_no_slower_than_the_hand_written_specs():
    """GPT (one block) on dp x tp, parameters and optimizer state AUTO, the batch over dp: the modeled
    step is at most the best of DP, ZeRO-3, Megatron and Megatron + DP; results equal the unsharded
    step. CI compares against DP and Megatron only (each compile takes seconds)."""
    import dataclasses

    import optree

    from examples.models import gpt
    from tests.test_transformers import MESH, _batch, _step
    from tests.test_transformers import OPT as GPT_OPT
    from tests.transformer_specs import configurations

    cfg = dataclasses.replace(gpt.Config(), layers=1)
    params = gpt.init(cfg)
    args = (params, GPT_OPT.init(params), *_batch(cfg))
    step = _step(gpt, cfg)

    def seconds(pspec, sspec, bspec):
        f = sharded(
            step,
            mesh=MESH,
            in_specs=(pspec, sspec, bspec, bspec),
            out_specs=(pspec, sspec, P()),
            cost_model=MODEL,
        )
        p = f.lower(*args).program
        return modeled_time(p.traced.module.graph, p.prop, p.mesh, MODEL).total_s, f

    names = ["dp", "tp_megatron"] if os.environ.get("CI") else ["dp", "zero3", "tp_megatron", "dp_x_tp"]
    best = min(
        seconds(ps, GPT_OPT.state_specs(ps), bs)[0]
        for ps, bs, _ in (configurations(params)[n] for n in names)
    )
    t_auto, f = seconds(AUTO, AUTO, P("dp"))
    assert t_auto <= best * (1 + 1e-9)
    for a, b in zip(optree.tree_leaves(f(*args)), optree.tree_leaves(step(*args)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(
    bool(os.environ.get("CI")),
    reason="two AUTO plans of a GPT block (each with its next-best solves) take minutes on 2 shared "
    "cores; in CI the memory limit is covered on the MLP (test_auto_under_a_memory_limit_...)",
)
def test_gpt_auto_under_a_memory_limit_dp_exceeds_picks_a_plan_that_fits():
    """GPT (one block) on dp x tp, every parameter and moment AUTO, a memory limit below what DP
    holds: the chosen layouts fit, and results equal the unsharded step."""
    import dataclasses

    import optree

    from examples.models import gpt
    from tests.test_transformers import MESH, _batch, _step
    from tests.test_transformers import OPT as GPT_OPT

    cfg = dataclasses.replace(gpt.Config(), layers=1)
    params = gpt.init(cfg)
    args = (params, GPT_OPT.init(params), *_batch(cfg))
    step = _step(gpt, cfg)

    def lower(pspec, sspec, model):
        f = sharded(
            step,
            mesh=MESH,
            in_specs=(pspec, sspec, P("dp"), P("dp")),
            out_specs=(pspec, sspec, P()),
            cost_model=model,
        )
        return f, f.lower(*args)

    rep = {k: P() for k in params}
    _, dp = lower(rep, GPT_OPT.state_specs(rep), MODEL)
    limit = int(_held(dp) * 0.6)
    f, low = lower(AUTO, AUTO, CostModel(latency_s=0.0, memory_bytes=limit))
    assert _held(low) <= limit < _held(dp)
    for a, b in zip(optree.tree_leaves(f(*args)), optree.tree_leaves(step(*args)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_memory_limit_counts_the_largest_block_and_holds_on_one_device_too():
    """An uneven split holds the largest block (5 rows over 3 devices: 2), not the floor of the even
    share, which once let the planner exceed the limit by half; a 1-device mesh and a limit of 0
    are limits too."""
    assert held_bytes((5, 4), 4, Sharding((("dp",), ())), Mesh({"dp": 3}, simulate=True)) == 2 * 4 * 4
    assert held_bytes((1,), 4, Sharding((("dp",),)), Mesh({"dp": 2}, simulate=True)) == 4

    def f(x, w):
        return (x @ w).tanh()

    x, w = torch.randn(5, 8), torch.randn(8, 8)
    for mesh, limit in ((Mesh({"dp": 1}, simulate=True), 100), (Mesh({"dp": 3}, simulate=True), 0)):
        step = sharded(
            f,
            mesh=mesh,
            in_specs=(P("dp"), AUTO),
            out_specs=P("dp"),
            cost_model=CostModel(memory_bytes=limit),
        )
        with pytest.raises(ShardingError, match=f"memory_bytes={limit} per device"):
            step(x, w)


def test_cost_model_arguments_are_checked():
    import math

    for kwargs, text in (
        ({"latency_s": math.nan}, "latency_s=nan"),
        ({"latency": {"dp": -1.0}}, "latency\\['dp'\\]=-1.0"),
        ({"bandwidth_bytes_per_s": "100e9"}, "bandwidth_bytes_per_s='100e9'"),
        ({"bandwidth": 1e9}, "must map mesh axis names to numbers"),
        ({"memory_bytes": "1GB"}, "memory_bytes='1GB'"),
    ):
        with pytest.raises(ShardingError, match=text):
            CostModel(**kwargs)
    with pytest.raises(ShardingError, match=r"needs a shardspec\.CostModel, got dict"):
        sharded(STEP, mesh=MESH, in_specs=(), out_specs=(), cost_model={"latency_s": 0})
    with pytest.raises(ShardingError, match="gives bandwidth or latency for \\['pp'\\]"):
        sharded(STEP, mesh=MESH, in_specs=(), out_specs=(), cost_model=CostModel(bandwidth={"pp": 1e9}))


def _pipelined_loss(p, x, y):
    h = shardspec.pipeline_boundary(torch.tanh(x @ p["w0"]))
    return torch.nn.functional.cross_entropy(h @ p["w1"], y)


@pytest.mark.parametrize("memory", [None, 12000])
def test_auto_with_a_pipeline_never_splits_over_the_pipeline_axis(memory):
    """Each pipeline position computes only its stages' values: an AUTO layout over the pipeline
    axis returned blocks never computed (wrong gradients; with a memory limit, a gather that hung)."""
    from shardspec import Pipeline

    opt = optim.sgd(lr=0.1)

    def step(p, s, x, y):
        loss, g = shardspec.value_and_grad(_pipelined_loss, microbatches=2)(p, x, y)
        p, s = opt.update(g, s, p)
        return p, s, loss

    g = torch.Generator().manual_seed(0)
    p = {"w0": torch.randn(64, 64, generator=g) / 8, "w1": torch.randn(64, 4, generator=g) / 8}
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
    run = sharded(
        step,
        mesh=Mesh({"pp": 2, "dp": 2}, simulate=True),
        in_specs=(AUTO, AUTO, P("dp"), P("dp")),
        out_specs=(AUTO, AUTO, P()),
        pipeline=Pipeline("pp", "1f1b"),
        cost_model=CostModel(memory_bytes=memory) if memory else None,
    )
    s = opt.init(p)
    got, want = optree.tree_leaves(run(p, s, x, y)), optree.tree_leaves(step(p, s, x, y))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    prog = run.lower(p, s, x, y).program
    assert all("pp" not in spec.axes for spec in (*prog.in_specs, *prog.out_specs))
