"""Scheduling of the loss's scalar reductions under data parallelism (passes/hoist.py, the bucket
rule in passes/bucketing.py, passes/sink.py): cross-entropy's count, computed from the batch
alone, is reduced from the program's start while forward runs; the loss sum waits for the end and
shares the gradient bucket, so the step launches as many collectives as DDP's two buckets and no
rank waits on another in the middle of the step. The step still equals the unsharded one."""

from __future__ import annotations

import optree
import torch

import shardspec
from compiler.passes.graph import LAUNCHES
from examples.models import gpt
from shardspec import Mesh, P, optim, sharded

CFG = gpt.Config(vocab=32, seq=16, d=32, heads=4, layers=2)
OPT = optim.adamw(lr=1e-3, eps=1e-6)


def _train(p, s, tok, tgt):
    loss, grads = shardspec.value_and_grad(lambda q, a, b: gpt.loss_fn(q, a, b, CFG))(p, tok, tgt)
    return (*OPT.update(grads, s, p), loss)


def test_the_count_is_reduced_during_forward_and_the_loss_joins_the_gradient_bucket():
    params = gpt.init(CFG)
    pspec = {k: P() for k in params}
    step = sharded(
        _train,
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(pspec, OPT.state_specs(pspec), P("dp"), P("dp")),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
    )
    tok = torch.randint(0, CFG.vocab, (4, CFG.seq), generator=torch.Generator().manual_seed(0))
    state = OPT.init(params)
    nodes = list(step.lower(params, state, tok, tok).program.programs[0].graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    launches = [n for n in nodes if n.op == "call_function" and n.target in LAUNCHES]
    products = [
        pos[n] for n in nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    ]
    assert len(launches) == 2  # DDP's two buckets (its small first one, then the rest)
    count, grads = launches
    assert pos[count] < min(products)  # issued before forward's first product
    (wait,) = count.users
    assert pos[wait] - pos[count] > len(nodes) // 8  # waited for well after: forward ran meanwhile
    assert max(products) < pos[grads]  # the loss sum and every gradient: one launch at the end
    got = step(params, state, tok, tok)
    want = _train(params, state, tok, tok)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
