"""Property: a one-block GPT or Llama training step equals the unsharded step for random meshes and
random valid specs on every parameter, both AdamW moments, the batch and the residual stream (heads,
hidden, batch and sequence dims all end up split, evenly or not)."""

import dataclasses

import optree
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardspec
from examples.models import gpt, llama
from shardspec import P, optim, sharded
from tests.strategies import meshes, specs

OPT = optim.adamw(lr=1e-3, eps=1e-6, weight_decay=0.0)  # eps: see test_transformers.py


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_transformer_block_step_equals_unsharded(data):
    mod = data.draw(st.sampled_from([gpt, llama]), label="model")
    mesh = data.draw(meshes(max_devices=8, max_axes=3), label="mesh")
    cfg = dataclasses.replace(mod.Config(), layers=1)
    params = mod.init(cfg)
    pspec = {k: data.draw(specs(mesh, v.dim()), label=k) for k, v in params.items()}
    sspec = {"step": P(), "m": {k: data.draw(specs(mesh, v.dim())) for k, v in params.items()}, "v": pspec}
    bspec = data.draw(specs(mesh, 2), label="tokens")
    residual = data.draw(st.one_of(st.none(), specs(mesh, 3)), label="residual")
    cfg = dataclasses.replace(cfg, residual=residual)

    def step(p, s, tok, tgt):
        loss, grads = shardspec.value_and_grad(mod.loss_fn)(p, tok, tgt, cfg)
        p, s = OPT.update(grads, s, p)
        return p, s, loss

    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g)
    tgt = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g)
    state = OPT.init(params)
    f = sharded(step, mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P()))
    got, want = f(params, state, tok, tgt), step(params, state, tok, tgt)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
