"""Uneven dims (torch.chunk layout) are computed exactly: each rank runs its own local shapes."""

import optree
import torch

from examples.models import mlp
from shardspec import Mesh, P, local_shape, optim, sharded

OPT = optim.adamw(lr=1e-2, weight_decay=0.0)
STEP = mlp.make_step(OPT)


def test_uneven_hidden_and_batch_dims_match_unsharded():
    mesh = Mesh({"dp": 4, "tp": 2}, simulate=True)
    params = mlp.init(6, 10, 3)  # hidden 10 over tp=4? here over dp: blocks 3,3,3,1
    state = OPT.init(params)
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))  # batch 7 over tp=2: blocks 4,3
    pspec = {"w1": P(None, "dp"), "b1": P("dp"), "w2": P("dp", None)}
    f = sharded(
        STEP,
        mesh=mesh,
        in_specs=(pspec, OPT.state_specs(pspec), P("tp"), P("tp")),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
    )
    got, want = f(params, state, x, y), STEP(params, state, x, y)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    program = f.lower(params, state, x, y).program
    assert program.programs[0] is not program.programs[-1]  # per-rank programs
    assert local_shape((6, 10), mesh, P(None, "dp"), 0) == (6, 3)
    assert local_shape((6, 10), mesh, P(None, "dp"), 7) == (6, 1)


def test_empty_shards_are_fine():
    mesh = Mesh({"dp": 4}, simulate=True)
    w = torch.randn(3, 5)  # 3 rows over 4 devices: blocks 1,1,1,0

    def step(w, x):
        return (x @ w.t()).relu().sum(0)

    f = sharded(step, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    x = torch.randn(2, 5)
    torch.testing.assert_close(f(w, x), step(w, x))


def test_kernels_that_reject_empty_blocks_never_get_one():
    """4 channels over 3 devices is torch.chunk blocks 2, 2, 0: pooling must not see the empty one."""
    mesh = Mesh({"a": 3}, simulate=True)

    def pool(x):
        return torch.nn.functional.max_pool1d(x, 2)

    x = torch.randn(2, 4, 9)
    f = sharded(pool, mesh=mesh, in_specs=(P(None, "a"),), out_specs=P())
    torch.testing.assert_close(f(x), pool(x))


def test_an_uneven_gpt_step_compiles_without_error_logs():
    """Shapes that do not propagate on a rank with a shorter block are handled (its program is not
    bucketed); torch's fake-tensor ERROR log of each such failure must not reach the user."""
    import logging

    import shardspec
    from examples.models import gpt

    cfg = gpt.Config(vocab=30, seq=8, d=20, heads=2, layers=1)
    params = gpt.init(cfg)
    pspec = {k: P("dp") for k in params}
    opt = optim.adamw(lr=1e-2)

    def step(p, s, tok):
        loss, g = shardspec.value_and_grad(gpt.loss_fn)(p, tok, tok, cfg)
        return (*opt.update(g, s, p), loss)

    f = sharded(
        step,
        mesh=Mesh({"dp": 3}, simulate=True),
        in_specs=(pspec, opt.state_specs(pspec), P("dp")),
        out_specs=(pspec, opt.state_specs(pspec), P()),
    )
    tok = torch.randint(0, cfg.vocab, (5, cfg.seq), generator=torch.Generator().manual_seed(0))
    logged: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = logged.append  # type: ignore[method-assign]
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(handler)
    try:
        got = f(params, opt.init(params), tok)
    finally:
        logger.removeHandler(handler)
    assert not logged, [r.getMessage() for r in logged]
    # the loss (AdamW's update of the key bias, whose true gradient is zero, turns rounding noise
    # into steps of lr: the updated parameters are compared on even meshes elsewhere)
    torch.testing.assert_close(got[2], step(params, opt.init(params), tok)[2], rtol=1e-6, atol=0)
