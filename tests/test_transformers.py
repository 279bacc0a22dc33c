"""GPT and Llama training steps (forward, backward, AdamW) under six spec configurations each equal
the unsharded step; splitting heads over tp moves no q/k/v.

AdamW runs with eps=1e-6: GPT's key bias has an exactly zero gradient (softmax ignores a shift of
the keys), so its computed gradient is rounding noise, which AdamW with eps=1e-8 would blow up into
lr-sized updates that differ with any change of summation order, sharded or not.
"""

import dataclasses

import optree
import pytest
import torch
from torch.func import functional_call

import shardspec
from examples.models import gpt, llama
from shardspec import Mesh, P, ShardingError, optim, sharded
from tests.transformer_specs import configurations

MESH = Mesh({"dp": 2, "tp": 2}, simulate=True)
OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
MODELS = {"gpt": (gpt, gpt.GPT), "llama": (llama, llama.Llama)}


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g)
    tgt = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g)
    tgt[0, :3] = -100  # ignored positions
    return tok, tgt


def _step(mod, cfg, module_style=False):
    if module_style:
        model = MODELS[mod.__name__.rsplit(".", 1)[1]][1](cfg)

        def loss_fn(p, tok, tgt):
            logits = functional_call(model, p, (tok,))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))
    else:

        def loss_fn(p, tok, tgt):
            return mod.loss_fn(p, tok, tgt, cfg)

    def step(p, s, tok, tgt):
        loss, grads = shardspec.value_and_grad(loss_fn)(p, tok, tgt)
        p, s = OPT.update(grads, s, p)
        return p, s, loss

    return step


def _check(name, config, module_style=False):
    mod = MODELS[name][0]
    cfg = mod.Config()
    params = mod.init(cfg)
    pspec, bspec, residual = configurations(params)[config]
    cfg = dataclasses.replace(cfg, residual=residual)
    step = _step(mod, cfg, module_style)
    state = OPT.init(params)
    tok, tgt = _batch(cfg)
    f = sharded(
        step,
        mesh=MESH,
        in_specs=(pspec, OPT.state_specs(pspec), bspec, bspec),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
    )
    got, want = f(params, state, tok, tgt), step(params, state, tok, tgt)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return f.lower(params, state, tok, tgt)


CONFIGS = ["dp", "tp_megatron", "sequence_parallel", "zero3", "dp_x_tp", "heads_split"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_training_step_matches_unsharded(name, config):
    _check(name, config)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_module_style_with_functional_call(name):
    _check(name, "dp_x_tp", module_style=True)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_splitting_heads_moves_no_q_k_v(name):
    low = _check(name, "heads_split")
    attention_lines = ("qkv", "wq", "wk", "wv", "scaled_dot_product_attention", "split_heads")
    for c in low.collectives():
        if c.kind in ("all_gather", "all_to_all"):
            assert not any(k in c.source for k in attention_lines), (c.kind, c.shape, c.reason)
    # q.kT and probs.v run per head locally: their batched matmuls need nothing moved
    assert not any("matmul" in c.reason for c in low.collectives())


def test_sequence_parallel_keeps_the_residual_stream_split():
    low = _check("llama", "sequence_parallel")
    kinds = {c.kind for c in low.collectives()}
    assert "all_gather" in kinds and "reduce_scatter" in kinds  # SP: gather in, scatter out


def test_alpha_dropout_is_refused():  # dropout itself is counter-based: tests/test_random.py
    def step(x):
        return torch.nn.functional.alpha_dropout(x, p=0.1, training=True).sum()

    with pytest.raises(ShardingError, match=r"alpha_dropout\(p=0.1\) at .*test_transformers.py"):
        sharded(step, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(torch.randn(4, 4))


def test_random_ops_without_a_counter_based_form_are_refused():
    def step(x):
        return (x + torch.randint(0, 3, (4, 4))).sum()

    with pytest.raises(ShardingError, match="random numbers inside a sharded step"):
        sharded(step, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(torch.randn(4, 4))
