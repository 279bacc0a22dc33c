"""Arguments that share memory: a tensor object passed twice is two inputs (values, as in JAX), and
a donated argument may not overlap another argument (its buffer is written in place)."""

from __future__ import annotations

import pytest
import torch

import shardspec
from shardspec import Mesh, P, ShardingError, optim, sharded


def _loss(p, x):
    return ((x @ p["a"]) * (x @ p["b"]) ** 2).sum()


def _step_fn(opt):
    def step(p, s, x):
        loss, g = shardspec.value_and_grad(_loss)(p, x)
        p, s = opt.update(g, s, p)
        return p, s, loss

    return step


def _specs(opt):
    ps = {"a": P(), "b": P()}
    return (ps, opt.state_specs(ps), P("dp")), (ps, opt.state_specs(ps), P())


def test_a_tensor_passed_twice_is_two_inputs_and_later_distinct_leaves_stay_right():
    opt = optim.sgd(lr=0.1)

    def step(p, x):
        loss, g = shardspec.value_and_grad(_loss)(p, x)
        return opt.update(g, {}, p)[0], loss

    ps = {"a": P(), "b": P()}
    f = sharded(step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(ps, P("dp")), out_specs=(ps, P()))
    w = torch.ones(2, 2, dtype=torch.float64)
    x = torch.ones(4, 2, dtype=torch.float64)
    got, want = f({"a": w, "b": w}, x), step({"a": w, "b": w}, x)  # one object under two paths
    torch.testing.assert_close(got, want)
    for _ in range(2):  # now distinct leaves with different values, through the cached program
        got, want = f(got[0], x), step(want[0], x)
        torch.testing.assert_close(got, want)


def test_donating_an_argument_that_shares_memory_with_another_is_refused():
    opt = optim.adamw(lr=0.1)
    ins, outs = _specs(opt)
    f = sharded(
        _step_fn(opt), mesh=Mesh({"dp": 2}, simulate=True), in_specs=ins, out_specs=outs, donate=(0, 1)
    )
    w = torch.ones(2, 2, dtype=torch.float64)
    x = torch.ones(4, 2, dtype=torch.float64)
    with pytest.raises(ShardingError) as e:
        f({"a": w, "b": w}, opt.init({"a": w, "b": w}), x)
    assert "p['b'] shares memory with p['a']" in str(e.value) and "clone()" in str(e.value)


def test_donated_disjoint_views_of_one_buffer_are_updated_right():
    opt = optim.adamw(lr=0.1)
    ins, outs = _specs(opt)
    f = sharded(
        _step_fn(opt), mesh=Mesh({"dp": 2}, simulate=True), in_specs=ins, out_specs=outs, donate=(0, 1)
    )
    flat = torch.linspace(-1, 1, 8, dtype=torch.float64)
    x = torch.linspace(0.5, 2, 8, dtype=torch.float64).reshape(4, 2)
    p = {"a": flat[:4].view(2, 2), "b": flat[4:].view(2, 2)}
    want = _step_fn(opt)({k: v.clone() for k, v in p.items()}, opt.init(p), x)
    got = f(p, opt.init(p), x)
    torch.testing.assert_close(got, want)
