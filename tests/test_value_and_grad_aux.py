"""``value_and_grad(has_aux=True)``: aux comes back with the loss (per microbatch with
microbatches), sharded equals unsharded, pipelined too; a loss function not returning a pair, or
a non-tensor aux, is a clear error."""

import optree
import pytest
import torch
import torch.nn.functional as F

import shardspec
from benchmarks import pipeline_model as pm
from shardspec import Mesh, P, Pipeline, ShardingError, optim, sharded

OPT = optim.adamw(lr=1e-2)


def _loss_with_metrics(params, x, y):
    logits = pm.forward(params, x)
    loss = F.cross_entropy(logits, y)
    return loss, {"acc": (logits.argmax(-1) == y).float().mean(), "logits": logits}


def _step(microbatches):
    def step(params, state, x, y):
        vg = shardspec.value_and_grad(_loss_with_metrics, has_aux=True, microbatches=microbatches)
        (loss, aux), grads = vg(params, x, y)
        params, state = OPT.update(grads, state, params)
        return params, state, loss, aux

    return step


def _close(got, want):
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _run(step, mesh_shape, pipeline=None):
    params = pm.init(4, 8, 16, 4)
    x, y = pm.data(16, 8, 4)
    state = OPT.init(params)
    ps, ss, xs, ys = pm.specs(params, "tp" in mesh_shape, "dp" in mesh_shape, OPT)
    f = sharded(
        step,
        mesh=Mesh(mesh_shape, simulate=True),
        in_specs=(ps, ss, xs, ys),
        out_specs=(ps, ss, P(), P()),
        pipeline=pipeline,
    )
    return f(params, state, x, y), step(params, state, x, y)


def test_aux_returned_with_the_loss_and_equal_sharded():
    got, want = _run(_step(None), {"dp": 2, "tp": 2})
    _close(got, want)
    loss, aux = want[2], want[3]
    assert aux["logits"].shape == (16, 4) and aux["acc"].dim() == 0
    torch.testing.assert_close(loss, F.cross_entropy(aux["logits"], pm.data(16, 8, 4)[1]))


@pytest.mark.parametrize("pipeline", [None, Pipeline("pp", "1f1b")])
def test_aux_stacked_per_microbatch(pipeline):
    shape = {"pp": 2, "dp": 2} if pipeline else {"dp": 2}
    got, want = _run(_step(4), shape, pipeline)
    _close(got, want)
    aux = want[3]
    assert aux["acc"].shape == (4,) and aux["logits"].shape == (4, 4, 4)
    x, _ = pm.data(16, 8, 4)  # chunk k holds rows k, k + 4, ...: its logits are those rows'
    params = pm.init(4, 8, 16, 4)
    torch.testing.assert_close(aux["logits"][1], pm.forward(params, x[1::4]))


def test_not_a_pair_is_an_error():
    def loss_only(params, x, y):
        return F.cross_entropy(pm.forward(params, x), y)

    def step(params, x, y):
        return shardspec.value_and_grad(loss_only, has_aux=True)(params, x, y)

    params = pm.init(2, 8, 16, 4)
    x, y = pm.data(8, 8, 4)
    with pytest.raises(ShardingError, match=r"has_aux=True\) needs loss_only to return a pair \(loss, aux\)"):
        step(params, x, y)


def test_python_number_aux_is_an_error():
    def loss_fn(params, x, y):
        return F.cross_entropy(pm.forward(params, x), y), {"n": 3}

    params = pm.init(2, 8, 16, 4)
    x, y = pm.data(8, 8, 4)
    for mb in (None, 2):
        vg = shardspec.value_and_grad(loss_fn, has_aux=True, microbatches=mb)
        with pytest.raises(ShardingError, match=r"(?s)aux\['n'\] is a int.*as_tensor"):
            vg(params, x, y)


@pytest.mark.parametrize("microbatches", [None, 2])
def test_none_in_aux_comes_back_as_none(microbatches):
    """torch.func takes tensors only: None leaves are set aside and put back (as JAX allows)."""

    def loss_fn(w, x):
        y = x @ w.t()
        return y.pow(2).mean(), {"max": y.max().detach(), "extra": None}

    def step(w, x):
        return shardspec.value_and_grad(loss_fn, has_aux=True, microbatches=microbatches)(w, x)

    w, x = torch.randn(3, 4), torch.randn(8, 4)
    run = sharded(
        step,
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(P(), P("dp")),
        out_specs=((P(), {"max": P(), "extra": None}), P()),
    )
    (loss, aux), grad = run(w, x)
    (want_loss, want_aux), want_grad = step(w, x)
    assert aux["extra"] is None and want_aux["extra"] is None
    _close((loss, aux["max"], grad), (want_loss, want_aux["max"], want_grad))
