"""ZeRO-3's memory schedule (compiler/passes/regather.py) and the peak-memory estimate of cost():
parameters gathered again for backward, gradients freed once their reduce-scatter is done, and the
estimate's drop; results equal with the schedule on and off."""

from __future__ import annotations

import dataclasses
import itertools

import optree
import torch

import shardspec
from examples.models import gpt
from shardspec import Mesh, P, optim, sharded

N = 4
PHI = (N - 1) / N
OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
ops = torch.ops.shardspec


def _mlp3(params, x, y):
    """Three bias-free layers: backward reads w1 and w2 (the hidden gradients), never w0."""
    h = torch.tanh(x @ params["w0"])
    h = torch.tanh(h @ params["w1"])
    return torch.nn.functional.cross_entropy(h @ params["w2"], y)


def _step(loss_fn):
    def step(p, s, *batch):
        loss, g = shardspec.value_and_grad(loss_fn)(p, *batch)
        p, s = OPT.update(g, s, p)
        return p, s, loss

    return step


def _zero3(step, params, passes):
    batch_spec = P("dp")
    pspec = {k: P("dp") for k in params}
    return sharded(
        step,
        mesh=Mesh({"dp": N}, simulate=True),
        in_specs=(pspec, OPT.state_specs(pspec), batch_spec, batch_spec),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
        passes=passes,
    )


def _gathers_and_scatters(low):
    records = [r for r in low.collectives() if r.shape != ()]
    gathers = sum(r.bytes_per_rank for r in records if r.kind == "all_gather")
    scatters = sum(r.bytes_per_rank for r in records if r.kind == "reduce_scatter")
    return gathers, scatters


def test_regather_sends_parameters_read_in_backward_twice_and_computes_the_same():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(8, 8, generator=g) / 3 for k in ("w0", "w1", "w2")}
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 8, (16,), generator=g)
    step = _step(_mlp3)
    psi, psi_backward = 3 * 64, 2 * 64
    out, bytes_ = {}, {}
    for regather in (True, False):
        f = _zero3(step, params, {"regather": regather})
        out[regather] = f(params, OPT.init(params), x, y)
        bytes_[regather] = _gathers_and_scatters(f.lower(params, OPT.init(params), x, y))
    for a, b in zip(optree.tree_leaves(out[True]), optree.tree_leaves(out[False]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # k phi Psi (2 w_p + w_g) for what backward reads; phi Psi (w_p + w_g) without the schedule
    assert bytes_[True] == (PHI * (psi + psi_backward) * 4, PHI * psi * 4)
    assert bytes_[False] == (PHI * psi * 4, PHI * psi * 4)


def _gpt(passes):
    cfg = gpt.Config(layers=3)
    params = gpt.init(cfg)

    def loss_fn(p, tok, tgt):
        return gpt.loss_fn(p, tok, tgt, cfg)

    tok = torch.randint(0, cfg.vocab, (8, cfg.seq), generator=torch.Generator().manual_seed(1))
    f = _zero3(_step(loss_fn), params, passes)
    return f, params, OPT.init(params), tok


def test_gpt_zero3_regather_doubles_weight_gathers_and_lowers_the_peak():
    small = {"zero_bucket_bytes": 4096}
    on, params, state, tok = _gpt(small)
    off = _gpt({**small, "regather": False})[0]
    low_on, low_off = on.lower(params, state, tok, tok), off.lower(params, state, tok, tok)
    (g_on, s_on), (g_off, s_off) = _gathers_and_scatters(low_on), _gathers_and_scatters(low_off)
    assert s_on == s_off  # gradients are reduced once either way
    again = [c for launch in low_on.launches() for c in launch if c.node.endswith("@regather")]
    assert g_on == g_off + sum(c.bytes_per_rank for c in again)
    assert 1.8 * g_off < g_on <= 2 * g_off  # every weight matrix again; biases and wte are not read
    assert low_on.cost().peak_memory_bytes_per_rank < low_off.cost().peak_memory_bytes_per_rank
    for a, b in zip(
        optree.tree_leaves(on(params, state, tok, tok)),
        optree.tree_leaves(off(params, state, tok, tok)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_backward_gathers_are_prefetched_one_layer_ahead_not_at_the_top_of_backward():
    f, params, state, tok = _gpt({"zero_bucket_bytes": 4096})
    gm = f.lower(params, state, tok, tok).program.programs[0]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    again = [
        n
        for n in nodes
        if n.target is ops.all_gather.default
        and any(m.endswith("@regather") for m in n.meta.get("shardspec_members", ()))
    ]
    assert len(again) >= 3
    backward = [i for i, n in enumerate(nodes) if n.meta.get("shardspec_backward")]

    def first_use(gather):
        (wait,) = gather.users
        return min(pos[u] for u in wait.users)

    for k in range(1, len(again)):  # issued one launch ahead: after the previous one's layer began
        assert first_use(again[k - 1]) > pos[again[k]] > pos[again[k - 1]]
    assert pos[again[-1]] > (backward[0] + backward[-1]) // 2  # the last in backward's second half


def test_a_gradient_reduce_scatter_is_waited_before_the_next_one_is_packed():
    f, params, state, tok = _gpt({"zero_bucket_bytes": 4096})
    gm = f.lower(params, state, tok, tok).program.programs[0]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    scatters = [n for n in nodes if n.target is ops.reduce_scatter.default]
    assert len(scatters) >= 3
    for c, following in itertools.pairwise(scatters):
        (wait,) = c.users
        packed = min(pos[x] for x in following.all_input_nodes)  # the next bucket's flat buffer
        assert pos[wait] < packed


def test_pass_options_name_the_memory_trade():
    from compiler import passes as cp

    assert cp.options(None).regather and cp.options(None).zero_bucket_bytes is None
    assert not cp.options({"regather": False}).regather
    assert dataclasses.replace(cp.PassOptions(), zero_bucket_bytes=1 << 20).zero_bucket_bytes == 1 << 20
