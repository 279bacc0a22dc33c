"""A user's own property test: my model gives the same answer however it is sharded.

Run it with ``python -m pytest examples/test_my_model.py`` (needs hypothesis: ``pip install -e
'.[test]'``). hypothesis draws a mesh and a spec for every input; ``assert_sharding_equivalent``
compiles the function for that layout, runs it on the simulated mesh and compares every result with
the plain PyTorch call, naming the result, mesh and specs when they differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardspec
from shardspec import P
from shardspec.testing import assert_sharding_equivalent, meshes, specs_for


def my_model(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ params["w1"] + params["b1"])
    return F.layer_norm(h @ params["w2"], (params["w2"].shape[1],))


def my_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(my_model(params, x), y)


def make_inputs(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = {
        "w1": torch.randn(6, 8, generator=g),
        "b1": torch.randn(8, generator=g),
        "w2": torch.randn(8, 5, generator=g),
    }
    return params, torch.randn(12, 6, generator=g), torch.randn(12, 5, generator=g)


@settings(max_examples=10, deadline=None)
@given(mesh=meshes(max_devices=4), data=st.data())
def test_forward_is_sharding_invariant(mesh: shardspec.Mesh, data: st.DataObject) -> None:
    params, x, _ = make_inputs()
    pspec = {name: data.draw(specs_for(t.shape, mesh), label=name) for name, t in params.items()}
    xspec = data.draw(specs_for(x.shape, mesh), label="x")
    assert_sharding_equivalent(
        my_model, (params, x), mesh=mesh, in_specs=(pspec, xspec), out_specs=P(), rtol=1e-4, atol=1e-5
    )


@settings(max_examples=5, deadline=None)
@given(mesh=meshes(max_devices=4, axis_names=("dp", "tp"), min_axes=2), data=st.data())
def test_gradients_are_sharding_invariant(mesh: shardspec.Mesh, data: st.DataObject) -> None:
    params, x, y = make_inputs()
    pspec = {name: data.draw(specs_for(t.shape, mesh), label=name) for name, t in params.items()}
    grad_fn = shardspec.value_and_grad(my_loss)
    assert_sharding_equivalent(
        grad_fn,
        (params, x, y),
        mesh=mesh,
        in_specs=(pspec, P("dp"), P("dp")),
        out_specs=(P(), pspec),
        rtol=1e-4,
        atol=1e-5,
    )
