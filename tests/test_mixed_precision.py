"""Mixed precision written the way a user would: bf16 compute with fp32 master parameters and
optimizer state, cast in the step. The cast pass (compiler/passes/cast.py) moves a cast that follows
a gather before it (bf16 travels: the bytes halve, the result is bit-identical), gradient reductions
run in a selectable dtype, the sharded step matches the same mixed-precision step unsharded, and
model-state bytes per rank follow ZeRO's formulas for DP, ZeRO-1, ZeRO-2 and ZeRO-3."""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F

import shardspec
from examples.models import gpt
from shardspec import Mesh, P, ShardingError, constrain, optim, sharded

OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
CFG = gpt.Config(vocab=64, seq=16, d=32, heads=4, layers=1)
BF16 = torch.bfloat16


def _loss(p, tok, tgt):
    return F.cross_entropy(gpt.forward(p, tok, CFG).float().reshape(-1, CFG.vocab), tgt.reshape(-1))


def _master_loss(gather_first):
    """fp32 master parameters cast to bf16 in the step (optionally pinned whole first, which makes
    the program gather fp32 and then cast: what the cast pass rewrites)."""

    def loss_fn(p32, tok, tgt):
        p = {k: (constrain(v, P()) if gather_first else v).to(BF16) for k, v in p32.items()}
        return _loss(p, tok, tgt)

    return loss_fn


def _batch(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, CFG.vocab, (rows, CFG.seq), generator=g),
        torch.randint(0, CFG.vocab, (rows, CFG.seq), generator=g),
    )


def _grads_step(loss_fn):
    def step(p, tok, tgt):
        return shardspec.value_and_grad(loss_fn)(p, tok, tgt)

    return step


def _zero3_grads(loss_fn, passes=None):
    params = gpt.init(CFG)
    split = {k: P("dp") for k in params}
    f = sharded(
        _grads_step(loss_fn),
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(split, P("dp"), P("dp")),
        out_specs=(P(), split),
        passes=passes,
    )
    return f, (params, *_batch(4))


def _bytes(f, args, kind, dtype=None):
    return sum(
        r.bytes_per_rank
        for r in f.lower(*args).collectives()
        if r.kind == kind and (dtype is None or r.dtype == dtype)
    )


def test_a_cast_after_a_gather_moves_before_it_bf16_travels_and_the_result_is_identical():
    on, args = _zero3_grads(_master_loss(gather_first=True))
    off, _ = _zero3_grads(_master_loss(gather_first=True), passes={"cast": False})
    assert _bytes(off, args, "all_gather", torch.float32) > 0
    assert _bytes(on, args, "all_gather", torch.float32) == 0
    assert _bytes(on, args, "all_gather", BF16) == _bytes(off, args, "all_gather") / 2
    assert on.lower(*args).cost().bytes_by_kind["all_gather"] == _bytes(off, args, "all_gather") / 2
    for a, b in zip(optree.tree_leaves(on(*args)), optree.tree_leaves(off(*args)), strict=True):
        assert torch.equal(a, b)  # casting commutes with concatenation: bit for bit


@pytest.mark.parametrize("reduce_dtype", [None, BF16, torch.float32])
def test_zero3_mixed_precision_matches_the_unsharded_mixed_precision_step(reduce_dtype):
    loss_fn = _master_loss(gather_first=False)
    f, args = _zero3_grads(loss_fn, passes={"reduce_dtype": reduce_dtype})
    loss, grads = f(*args)
    want_loss, want_grads = _grads_step(loss_fn)(*args)
    # bf16 products summed in another order (per-rank batch halves): bf16-sized differences
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=1e-2)
    for k in grads:
        assert grads[k].dtype == torch.float32
        torch.testing.assert_close(grads[k], want_grads[k], rtol=5e-2, atol=5e-3)
    psi = sum(v.numel() for v in args[0].values())
    assert _bytes(f, args, "all_gather", BF16) >= psi / 2 * 2  # every parameter gathered in bf16


def test_reduce_dtype_picks_the_gradient_reduction_dtype_and_its_bytes():
    loss_fn = _master_loss(gather_first=False)
    (f32, args), (b16, _) = (_zero3_grads(loss_fn, passes={"reduce_dtype": d}) for d in (torch.float32, BF16))
    scattered = {d: _bytes(f, args, "reduce_scatter") for d, f in ((32, f32), (16, b16))}
    assert _bytes(f32, args, "reduce_scatter", BF16) == 0
    assert _bytes(b16, args, "reduce_scatter", torch.float32) == 0
    assert scattered[16] == scattered[32] / 2 > 0
    a, b = f32(*args)[1], b16(*args)[1]
    for k in a:  # the bf16 reduction rounds the sum of two bf16 halves to bf16
        torch.testing.assert_close(a[k], b[k], rtol=2e-2, atol=2e-3)


def test_a_reduce_dtype_that_is_not_floating_is_refused():
    with pytest.raises(ShardingError, match="reduce_dtype") as e:
        sharded(
            _loss,
            mesh=Mesh({"dp": 2}, simulate=True),
            in_specs=(P(),),
            out_specs=P(),
            passes={"reduce_dtype": torch.int32},
        )
    assert "torch.bfloat16" in str(e.value)


def _zero_step(grad_specs):
    """DeepSpeed's mixed-precision ZeRO written as a step: bf16 parameters (the compute copy) and
    fp32 master + AdamW moments are carried; gradients are bf16, laid out by ``grad_specs``
    (P(): all-reduced, as ZeRO-1; P("dp"): reduce-scattered, as ZeRO-2/3); the new bf16
    parameters are the updated master cast back."""

    def step(p16, master, s, tok, tgt):
        loss, g = shardspec.value_and_grad(_loss)(p16, tok, tgt)
        g = {k: constrain(v, grad_specs[k]).float() for k, v in g.items()}
        master, s = OPT.update(g, s, master)
        return {k: v.to(BF16) for k, v in master.items()}, master, s, loss

    return step


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
def test_model_state_bytes_follow_the_zero_formulas(strategy, n):
    """ZeRO's count with K = 12 (fp32 master, m, v) and 2-byte parameters and gradients."""
    params = gpt.init(CFG)
    psi = sum(v.numel() for v in params.values())
    rep, split = {k: P() for k in params}, {k: P("dp") for k in params}
    p16s, ms, gs = {
        "dp": (rep, rep, rep),
        "zero1": (rep, split, rep),
        "zero2": (rep, split, split),
        "zero3": (split, split, split),
    }[strategy]
    f = sharded(
        _zero_step(gs),
        mesh=Mesh({"dp": n}, simulate=True),
        in_specs=(p16s, ms, OPT.state_specs(ms), P("dp"), P("dp")),
        out_specs=(p16s, ms, OPT.state_specs(ms), P()),
        donate=(0, 1, 2),
    )
    p16 = {k: v.to(BF16) for k, v in params.items()}
    tok, tgt = _batch(n)
    cost = f.lower(p16, params, OPT.init(params), tok, tgt).cost()
    formula = {"dp": 16, "zero1": 4 + 12 / n, "zero2": 2 + 14 / n, "zero3": 16 / n}[strategy] * psi
    assert abs(cost.model_state_bytes_per_rank - formula) <= 0.05 * formula
    assert cost.model_state_bytes_per_rank == (
        cost.state_bytes_per_rank + cost.grad_bytes_per_rank + cost.compute_param_bytes_per_rank
    )


def test_reduce_dtype_narrows_gradient_reductions_only_not_a_norm_computed_from_them():
    """A gradient norm's sum of squares under TP is reduced at its own dtype: only gradients (and
    their views and casts) take reduce_dtype, as FSDP's reduce_dtype does."""
    import shardspec

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 16, generator=g), torch.randn(32, 8, generator=g)

    def step(w, x):
        _, gw = shardspec.value_and_grad(lambda w, x: torch.tanh(x @ w).pow(2).mean())(w, x)
        return torch.sqrt((gw * gw).sum())

    f = sharded(
        step,
        mesh=Mesh({"tp": 2}, simulate=True),
        in_specs=(P(None, "tp"), P()),
        out_specs=P(),
        passes={"reduce_dtype": torch.bfloat16},
    )
    assert [c.dtype for c in f.lower(w, x).collectives()] == [torch.float32]
    torch.testing.assert_close(f(w, x), step(w, x))


def test_zero3_master_weights_reduce_scatter_gradients_before_the_bf16_rounding():
    """bf16 compute from fp32 master weights split over dp: a layer norm's weight gradient is an
    fp32 sum rounded to bf16. Each device's part may not be rounded on its own, and the sum is
    reduce-scattered in fp32 into the update's layout, not all-reduced whole: no fp32 tensor is
    all-reduced."""
    cfg = gpt.Config(vocab=64, seq=16, d=32, heads=4, layers=1)

    def loss_fn(p32: dict[str, torch.Tensor], tok: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        p = {k: v.to(torch.bfloat16) for k, v in p32.items()}
        return F.cross_entropy(gpt.forward(p, tok, cfg).float().reshape(-1, cfg.vocab), tgt.reshape(-1))

    opt = optim.adamw(lr=1e-3)
    params = gpt.init(cfg)
    ps = {k: P("dp") for k in params}

    def step(p: Any, s: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(loss_fn)(p, tok, tgt)
        return (*opt.update(grads, s, p), loss)

    f = sharded(
        step,
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(ps, opt.state_specs(ps), P("dp"), P("dp")),
        out_specs=(ps, opt.state_specs(ps), P()),
    )
    tok = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    launches = f.lower(params, opt.init(params), tok, tok).collectives()
    assert not [c for c in launches if c.kind == "all_reduce" and c.dtype == torch.float32 and c.shape]
    assert any(c.kind == "reduce_scatter" and c.dtype == torch.float32 for c in launches)


@pytest.mark.parametrize("rows", [10, 4])
def test_reduce_dtype_with_a_batch_that_splits_unevenly(rows):
    """The short rank's program was optimized on block 0's shapes, so the cast pass rewrote its
    reductions differently: the ranks' all-reduces did not match (an error). Each rank's program
    is now shaped by its own blocks."""
    opt = optim.adamw(lr=1e-2)

    def loss_fn(params, x):
        return ((x @ params["w1"] + params["b1"]) @ params["w2"]).square().mean()

    def train_step(params, state, x):
        loss, grads = shardspec.value_and_grad(loss_fn)(params, x)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(9, 14, generator=g),
        "b1": torch.randn(14, generator=g),
        "w2": torch.randn(14, 5, generator=g),
    }
    ps = {k: P() for k in params}
    step = sharded(
        train_step,
        mesh=Mesh({"dp": 3}, simulate=True),
        in_specs=(ps, opt.state_specs(ps), P("dp")),
        out_specs=(ps, opt.state_specs(ps), P()),
        passes={"reduce_dtype": torch.bfloat16},
    )
    x = torch.randn(rows, 9, generator=g)
    got = step(params, opt.init(params), x)
    want = train_step(params, opt.init(params), x)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # gradients summed in bf16


def test_reduce_dtype_reaches_a_gradient_an_sgd_update_scales_first():
    """p - lr * g: the pending sum passes the scaling, so the all-reduce takes lr * g; it is still
    a gradient, reduced in reduce_dtype and named by its parameter."""
    params = {"w": torch.randn(16, 4)}
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def loss(pb, x, y):
        return F.cross_entropy((x.bfloat16() @ pb["w"]).float(), y)

    def step(p, x, y):
        value, grads = shardspec.value_and_grad(loss)({k: v.bfloat16() for k, v in p.items()}, x, y)
        return {k: p[k] - 0.1 * grads[k].float() for k in p}, value

    f = sharded(
        step,
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=({"w": P()}, P("dp"), P("dp")),
        out_specs=({"w": P()}, P()),
        passes={"reduce_dtype": torch.bfloat16},
    )
    low = f.lower(params, x, y)
    reduced = [
        c for launch in low.launches() for c in launch if c.kind == "all_reduce" and c.shape == (16, 4)
    ]
    assert [c.dtype for c in reduced] == [torch.bfloat16]
    assert "gradient of p['w'] (after its mul by a number)" in low.explain()
    torch.testing.assert_close(f(params, x, y)[0]["w"], step(params, x, y)[0]["w"], rtol=1e-2, atol=1e-2)
