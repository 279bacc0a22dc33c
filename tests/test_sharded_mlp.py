"""@sharded on an MLP training step (forward, backward, AdamW): sharded == unsharded for any specs."""

import optree
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.models import mlp
from shardspec import P, optim, sharded
from tests.strategies import meshes, specs

OPT = optim.adamw(lr=1e-2, weight_decay=0.1)
STEP = mlp.make_step(OPT)


def _data(d_in, d_hidden, d_out, batch, seed=0):
    params = mlp.init(d_in, d_hidden, d_out, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randint(0, d_out, (batch,), generator=g)
    return params, OPT.init(params), x, y


def _close(got, want):
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_sharded_step_equals_unsharded_for_random_meshes_and_specs(data):
    mesh = data.draw(meshes(max_devices=8, max_axes=3), label="mesh")
    d_in, d_hidden, d_out, batch = (
        data.draw(st.sampled_from(v)) for v in ((4, 6, 8), (6, 8, 10), (3, 4), (8, 12, 6))
    )
    params, state, x, y = _data(d_in, d_hidden, d_out, batch)
    pspec = {k: data.draw(specs(mesh, v.dim()), label=f"params[{k}]") for k, v in params.items()}
    sspec = {
        "step": P(),
        "m": {k: data.draw(specs(mesh, v.dim())) for k, v in params.items()},
        "v": {k: data.draw(specs(mesh, v.dim())) for k, v in params.items()},
    }
    xspec, yspec = data.draw(specs(mesh, 2), label="x"), data.draw(specs(mesh, 1), label="y")
    step = sharded(STEP, mesh=mesh, in_specs=(pspec, sspec, xspec, yspec), out_specs=(pspec, sspec, P()))
    want = STEP(params, state, x, y)
    got = step(params, state, x, y)
    _close(got, want)
    got2 = step(*got[:2], x, y)  # a second step from the sharded results (cache hit)
    _close(got2, STEP(*want[:2], x, y))
