"""Layer norm backward on a pending gradient compiles to the textbook plan (reassociation of
pending sums: a sum read by several consumers is reduced once, where that sends least).

Under Megatron + DP (mesh dp x tp, column-parallel in-projections), the gradient reaching each
block's layer norm is a partial sum over tp (the input gradient of a column-parallel matmul). It
feeds the input's gradient, ``grad * x_hat`` summed for the weight and ``grad`` summed for the bias:
reducing it once, before all three, is one all-reduce of the (B, S, D) gradient over tp, and the
weight and bias gradients are then partial over dp only. Under sequence parallelism the gradient is
reduce-scattered over the sequence once and every sum reads that block: the parameters' gradients
are partial over tp and all-reduced as D-vectors, never a full (B, S, D) activation.

Bytes per rank by the ring formulas: all-reduce 2 (n - 1)/n S, reduce-scatter (n - 1)/n S (S the
full buffer on one rank), fp32.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import optree
import pytest
import torch

import shardspec
from compiler.explain import describe
from examples.models import gpt
from shardspec import CostModel, Mesh, P, optim, sharded
from tests.transformer_specs import configurations

MESH = Mesh({"dp": 2, "tp": 2}, simulate=True)
OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
CFG = gpt.Config(layers=2)
BATCH = 4


def _lower(config: str, model: CostModel | None) -> Any:
    params = gpt.init(CFG)
    pspec, bspec, residual = configurations(params)[config]
    cfg = dataclasses.replace(CFG, residual=residual)

    def step(p: Any, s: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(lambda p, a, b: gpt.loss_fn(p, a, b, cfg))(p, tok, tgt)
        p, s = OPT.update(grads, s, p)
        return p, s, loss

    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, CFG.vocab, (BATCH, CFG.seq), generator=g)
    tgt = torch.randint(0, CFG.vocab, (BATCH, CFG.seq), generator=g)
    args = (params, OPT.init(params), tok, tgt)
    f = sharded(
        step,
        mesh=MESH,
        in_specs=(pspec, OPT.state_specs(pspec), bspec, bspec),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
        cost_model=model,
    )
    for a, b in zip(optree.tree_leaves(f(*args)), optree.tree_leaves(step(*args)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return f.lower(*args)


def _ln_param_grads(low: Any) -> list[Any]:
    """Every collective moving a layer-norm parameter's gradient, in explain()'s words."""
    return [i for i in describe(low) if re.search(r"gradient of .*ln(1|2|_f)\.(weight|bias)", i.what)]


def _block_norm_grads(low: Any, kind: str, shape: tuple[int, ...]) -> list[Any]:
    """Collectives of a (B, S, D)-sized layer-norm gradient, filed under a layer-norm line."""
    return [
        r
        for r in low.collectives()
        if r.kind == kind
        and r.shape == shape
        and r.source.startswith("backward of")
        and "layer_norm" in r.source
    ]


# greedy propagation, and the planner on a machine where compute is dear (so it keeps the given
# Megatron split rather than recompute on every rank: on a machine where this small model's compute
# is free it may rightly do that, and send fewer bytes)
MODELS = [None, CostModel(latency_s=0.0, flops_per_s=1e9)]


@pytest.mark.parametrize("model", MODELS, ids=["greedy", "planner"])
def test_megatron_dp_layer_norm_backward_is_one_gradient_all_reduce(model: CostModel | None) -> None:
    low = _lower("dp_x_tp", model)
    b, s, d = BATCH // 2, CFG.seq, CFG.d
    norms = 2 * CFG.layers  # ln1 and ln2 of each block; ln_f's gradient is not pending
    reduces = _block_norm_grads(low, "all_reduce", (b, s, d))
    assert len(reduces) == norms and all(r.axes == ("tp",) for r in reduces)
    assert sum(r.bytes_per_rank for r in reduces) == norms * 2 * (1 / 2) * b * s * d * 4
    grads = _ln_param_grads(low)
    # every layer norm's weight and bias gradient (ln_f's too): summed over dp only, a D-vector each
    assert len(grads) == 2 * (norms + 1)
    assert all(i.kind == "all_reduce" and i.axes == ("dp",) and i.shape == (d,) for i in grads), grads
    assert not [r for r in low.collectives() if r.axes == ("dp", "tp") and r.shape == (d,)]


@pytest.mark.parametrize("model", MODELS, ids=["greedy", "planner"])
def test_sequence_parallel_layer_norm_backward_reduce_scatters_once(model: CostModel | None) -> None:
    low = _lower("sequence_parallel", model)
    s, d = CFG.seq, CFG.d
    norms = 2 * CFG.layers
    scatters = _block_norm_grads(low, "reduce_scatter", (BATCH, s, d))
    assert len(scatters) == norms and all(r.axes == ("tp",) for r in scatters)
    assert sum(r.bytes_per_rank for r in scatters) == norms * (1 / 2) * BATCH * s * d * 4
    assert not _block_norm_grads(low, "all_reduce", (BATCH, s, d))  # no full activation summed
    grads = _ln_param_grads(low)
    # the pending parameter gradients are D-vectors (each rank summed its own sequence block);
    # ln_f's weight too (its input is sequence-split), not its bias (its gradient is replicated)
    assert len(grads) == 2 * norms + 1
    assert all(i.kind == "all_reduce" and i.axes == ("tp",) and i.shape == (d,) for i in grads), grads
    # so are the row-parallel layers' biases (added to the sequence-split output, as Megatron-SP)
    biases = [i for i in describe(low) if re.search(r"gradient of .*(attn\.proj|mlp\.proj)\.bias", i.what)]
    assert len(biases) == 2 * CFG.layers and all(i.axes == ("tp",) and i.shape == (d,) for i in biases)
    assert sum(2 * (1 / 2) * d * 4 for _ in grads + biases) == pytest.approx(
        sum(r.bytes_per_rank for r in low.collectives() if r.shape == (d,) and r.axes == ("tp",))
    )
