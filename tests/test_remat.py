"""Activation checkpointing (``shardspec.remat``, ``compiler/passes/remat.py``): a remat'd layer's
activations are recomputed in backward, the step computes the same values under every strategy,
activation memory of a 4-layer GPT falls to one layer's worth plus the checkpoints, collectives
inside the region (ZeRO-3 gathers) are issued again and counted, the predicted peak matches the
one measured, and a region with side effects is refused."""

from __future__ import annotations

from collections import Counter

import optree
import pytest
import torch
import torch.nn.functional as F

import shardspec
from examples.models import gpt
from shardspec import Mesh, P, ShardingError, optim, sharded
from tests.test_memory import _measured_peak
from tests.transformer_specs import configurations

OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
MESH = Mesh({"dp": 2, "tp": 2}, simulate=True)


def _loss(cfg, policy="off"):
    """GPT's loss with each block wrapped in remat (``policy="off"``: not wrapped)."""
    block = gpt.block if policy == "off" else shardspec.remat(gpt.block, policy=policy)

    def loss_fn(p, tok, tgt):
        x = F.embedding(tok, p["wte"]) + p["wpe"][: tok.shape[1]]
        for i in range(cfg.layers):
            x = gpt.pin(block(p, f"h.{i}.", gpt.pin(x, cfg), cfg.heads), cfg)
        x = F.layer_norm(x, (cfg.d,), p["ln_f.weight"], p["ln_f.bias"])
        logits = F.linear(x, p["head.weight"])
        return F.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))

    return loss_fn


def _step(cfg, policy="off"):
    loss_fn = _loss(cfg, policy)

    def step(p, s, tok, tgt):
        loss, grads = shardspec.value_and_grad(loss_fn)(p, tok, tgt)
        p, s = OPT.update(grads, s, p)
        return p, s, loss

    return step


def _sharded(step, mesh, pspec, sspec, bspec, **kw):
    return sharded(
        step,
        mesh=mesh,
        in_specs=(pspec, OPT.state_specs(sspec), bspec, bspec),
        out_specs=(pspec, OPT.state_specs(sspec), P()),
        **kw,
    )


def _batch(cfg, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g)
    return tok, torch.randint(0, cfg.vocab, (rows, cfg.seq), generator=g)


STRATEGIES = ["dp", "zero1", "zero3", "tp_megatron", "sequence_parallel", "dp_x_tp"]


@pytest.mark.parametrize(
    ("strategy", "policy"),
    [(s, None) for s in STRATEGIES] + [("zero3", "save_matmuls"), ("dp_x_tp", "save_matmuls")],
)
def test_remat_computes_the_unsharded_step_under_every_strategy(strategy, policy):
    import dataclasses

    cfg = gpt.Config()
    params = gpt.init(cfg)
    table = configurations(params)
    if strategy == "zero1":
        pspec, sspec, bspec, residual = {k: P() for k in params}, {k: P("dp") for k in params}, P("dp"), None
    else:
        pspec, bspec, residual = table[strategy]
        sspec = pspec
    cfg = dataclasses.replace(cfg, residual=residual)
    tok, tgt = _batch(cfg, 4)
    args = (params, OPT.init(params), tok, tgt)
    plain = _step(cfg)(*args)
    f = _sharded(_step(cfg, policy), MESH, pspec, sspec, bspec)
    kept = _sharded(_step(cfg), MESH, pspec, sspec, bspec)
    got, same_without = f(*args), kept(*args)
    for a, b, c in zip(*(optree.tree_leaves(t) for t in (got, same_without, plain)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # the same ops, up to kernel rounding
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
    again = [r for r in f.lower(*args).collectives() if r.reason.endswith("(remat)")]
    if strategy == "zero3":
        assert any(r.kind == "all_gather" for r in again)  # the region's gathers, issued again


def _gpt4(strategy, policy, layers=4, n=2):
    cfg = gpt.Config(vocab=64, seq=32, d=64, heads=4, layers=layers)
    params = gpt.init(cfg)
    rep, split = {k: P() for k in params}, {k: P("dp") for k in params}
    pspec, sspec = {"dp": (rep, rep), "zero1": (rep, split), "zero3": (split, split)}[strategy]
    f = _sharded(_step(cfg, policy), Mesh({"dp": n}, simulate=True), pspec, sspec, P("dp"), donate=(0, 1))
    tok, tgt = _batch(cfg, 16 * n)
    return f, (params, OPT.init(params), tok, tgt), 16 * cfg.seq * cfg.d * 4


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_activation_memory_of_a_4_layer_gpt_falls_to_one_layer_plus_the_checkpoints(strategy):
    """One layer's worth = the activation peak of the same model with 1 layer (embedding, head and
    loss included); checkpoints = the other 3 layers' inputs (batch x seq x d per rank)."""
    f, args, checkpoint = _gpt4(strategy, None)
    full, _, _ = _gpt4(strategy, "off")
    one, one_args, _ = _gpt4(strategy, "off", layers=1)
    remat = f.lower(*args).cost().activation_peak_bytes_per_rank
    without = full.lower(*args).cost().activation_peak_bytes_per_rank
    one_layer = one.lower(*one_args).cost().activation_peak_bytes_per_rank
    assert remat <= one_layer + 3 * checkpoint
    assert remat < 0.35 * without
    if strategy == "zero3":
        saved = _gpt4(strategy, "save_matmuls")[0].lower(*args).cost().activation_peak_bytes_per_rank
        assert remat < saved < without  # matmul outputs kept: between the two
    fresh = optree.tree_map(torch.clone, args)  # f donates the first call's parameters and state
    for a, b in zip(optree.tree_leaves(f(*args)), optree.tree_leaves(full(*fresh)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero3"])
def test_remat_peak_predicted_matches_the_peak_measured(strategy):
    f, args, _ = _gpt4(strategy, None, layers=2)
    predicted = f.lower(*args).cost().peak_memory_bytes_per_rank
    measured = _measured_peak(f, args)
    assert abs(predicted - measured) <= 0.05 * measured


def test_zero3_region_gathers_are_issued_again_once_and_counted_in_bytes():
    """A gathered parameter a region reads is gathered once for forward and once more for the
    recomputation, which backward's own reads share (no third gather from regather)."""
    f, args, _ = _gpt4("zero3", None, layers=2)
    low = f.lower(*args)
    members = [c for launch in low.launches() for c in launch if c.kind == "all_gather"]
    again = Counter(c.node.split("@")[0] for c in members if "@" in c.node)
    assert any(c.node.endswith("@remat") for c in members)
    assert max(again.values()) == 1
    remat_bytes = sum(r.bytes_per_rank for r in low.collectives() if r.reason.endswith("(remat)"))
    assert remat_bytes == sum(c.bytes_per_rank for c in members if c.node.endswith("@remat")) > 0
    gathered = sum(c.bytes_per_rank for c in members)
    assert low.cost().bytes_by_kind["all_gather"] == pytest.approx(gathered)


def test_remat_off_by_the_pass_option_keeps_activations():
    f, args, _ = _gpt4("dp", None, layers=2)
    off = sharded(f.fn, mesh=f.mesh, in_specs=f.in_specs, out_specs=f.out_specs, passes={"remat": False})
    a = f.lower(*args).cost().activation_peak_bytes_per_rank
    b = off.lower(*args).cost().activation_peak_bytes_per_rank
    assert a < b


def _tiny(layer):
    def loss(w, x):
        return shardspec.remat(layer)(torch.tanh(x), w).sum()

    def step(w, x):
        return shardspec.value_and_grad(loss)(w, x)

    return sharded(step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P(), P("dp")), out_specs=P())


BUF = torch.zeros(4)


def _writes_closed_over(x, w):
    BUF.add_(1)
    return x @ w


def _writes_input(x, w):
    x[0] = 1.0
    return x @ w


def _writes_input_view(x, w):
    x[:, 0].mul_(2)
    return x @ w


@pytest.mark.parametrize("layer", [_writes_closed_over, _writes_input, _writes_input_view])
def test_remat_around_a_function_with_side_effects_is_refused(layer):
    with pytest.raises(ShardingError) as e:
        _tiny(layer)(torch.randn(4, 4), torch.randn(4, 4))
    text = str(e.value)
    assert f"remat({layer.__name__}) writes in place" in text
    assert "run again in backward" in text and "Fix:" in text and "make" in text


def test_in_place_ops_on_the_region_own_tensors_are_fine():
    def layer(x, w):
        h = x @ w
        h.add_(1)
        return torch.tanh(h)

    w, x = torch.randn(4, 4), torch.randn(4, 4)
    loss, grad = _tiny(layer)(w, x)
    want = torch.func.grad_and_value(lambda w: torch.tanh(torch.tanh(x) @ w + 1).sum())(w)
    torch.testing.assert_close(loss, want[1])
    torch.testing.assert_close(grad, want[0])


def test_a_bad_policy_names_the_choices():
    with pytest.raises(ShardingError, match="save_matmuls"):
        shardspec.remat(gpt.block, policy="save_everything")


def test_outside_a_sharded_step_remat_is_the_function():
    w, x = torch.randn(4, 4), torch.randn(4, 4)
    assert torch.equal(shardspec.remat(torch.matmul)(x, w), x @ w)


def test_cost_counts_a_collective_moved_whole_into_the_recomputation_once() -> None:
    """ZeRO-3 with microbatches and remat: a collective only backward used leaves forward for the
    recomputation; cost() and collectives() still listed the original too (2 all_to_alls, 512
    bytes, the run never sent)."""
    from collectives import count_bytes

    cfg = gpt.Config(vocab=16, seq=8, d=16, heads=4, layers=1)
    params = gpt.init(cfg)
    opt = optim.sgd(lr=0.1)

    def loss_fn(p, tok, tgt):
        x = F.embedding(tok, p["wte"]) + p["wpe"][: tok.shape[1]]
        x = shardspec.remat(lambda x, p: gpt.block(p, "h.0.", x, cfg.heads))(x, p)
        x = F.layer_norm(x, (cfg.d,), p["ln_f.weight"], p["ln_f.bias"])
        return F.cross_entropy(F.linear(x, p["head.weight"]).reshape(-1, cfg.vocab), tgt.reshape(-1))

    def step(p, s, tok, tgt):
        loss, g = shardspec.value_and_grad(loss_fn, microbatches=2)(p, tok, tgt)
        p, s = opt.update(g, s, p)
        return p, s, loss

    g = torch.Generator().manual_seed(5)
    tok, tgt = (torch.randint(0, 16, (4, 8), generator=g) for _ in range(2))
    z3 = {k: P("dp") for k in params}
    mesh = Mesh({"dp": 2}, simulate=True)
    f = sharded(step, mesh=mesh, in_specs=(z3, {}, P("dp"), P("dp")), out_specs=(z3, {}, P()))
    low = f.lower(params, {}, tok, tgt)
    with count_bytes() as counted:
        f(params, {}, tok, tgt)
    cost = low.cost()
    assert cost.collective_count == len(counted.records)
    assert cost.comm_bytes_per_rank == counted.total_bytes_per_rank
    kinds = Counter(r.kind for r in counted.records)  # launches: all_to_alls are never bucketed
    assert Counter(c.kind for c in low.collectives())["all_to_all"] == kinds["all_to_all"] > 0
