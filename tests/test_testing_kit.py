"""shardspec.testing's kit for users: the strategies draw valid meshes and specs, the equivalence
check passes equal runs and names the result, mesh and specs of a differing one, and the user-facing
example property test runs."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from examples import test_my_model
from shardspec import Mesh, P
from shardspec.layout import check_spec
from shardspec.testing import assert_sharding_equivalent, meshes, specs_for


@given(mesh=meshes(max_devices=6, axis_names=("a", "b"), min_axes=2))
def test_meshes_respect_the_bounds(mesh: Mesh) -> None:
    assert mesh.axis_names == ("a", "b") and mesh.simulated and 1 <= mesh.size <= 6


@given(mesh=meshes(), data=st.data(), shape=st.lists(st.integers(0, 9), max_size=3).map(tuple))
def test_specs_for_draws_valid_specs(mesh: Mesh, data: st.DataObject, shape: tuple[int, ...]) -> None:
    spec = data.draw(specs_for(shape, mesh))
    check_spec(shape, mesh, spec)  # raises on an invalid spec
    even = data.draw(specs_for(shape, mesh, even=True))
    for dim, length in enumerate(shape):
        assert length % math.prod(mesh.shape[a] for a in even.axes_of(dim)) == 0


def test_equal_runs_pass_and_return_the_sharded_result() -> None:
    x = torch.arange(24.0).reshape(6, 4)
    out = assert_sharding_equivalent(
        lambda t: {"sum": t.sum(0), "double": 2 * t},
        (x,),
        mesh=Mesh({"dp": 2, "tp": 2}, simulate=True),
        in_specs=(P("dp", "tp"),),
        out_specs={"sum": P(), "double": P("dp")},
    )
    assert torch.equal(out["double"], 2 * x)


def test_a_difference_names_the_result_mesh_and_specs() -> None:
    calls = []

    def fn(t: torch.Tensor) -> dict[str, torch.Tensor]:
        calls.append(1)  # Python runs once per trace: the traced program scales by 2, the eager call by 1
        return {"y": t * len(calls)}

    with pytest.raises(
        AssertionError, match=r"result\['y'\] differs .* on Mesh\(\{'dp': 2\}.*in_specs=\(P\('dp'\),\)"
    ):
        assert_sharding_equivalent(
            fn, (torch.ones(4),), mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"),), out_specs=P("dp")
        )


def test_missing_hypothesis_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    with pytest.raises(ImportError, match="pip install hypothesis"):
        meshes()


def test_the_users_example_property_tests_run() -> None:
    test_my_model.test_forward_is_sharding_invariant()
    test_my_model.test_gradients_are_sharding_invariant()


def test_specs_for_draws_tuples_of_every_length() -> None:
    """'Every valid spec': a dim split over all three axes of a 3-axis mesh is among the draws."""
    from hypothesis import find, settings

    mesh = Mesh({"a": 2, "b": 2, "c": 2}, simulate=True)
    spec = find(specs_for((8,), mesh), lambda s: len(s.axes_of(0)) == 3, settings=settings(max_examples=2000))
    check_spec((8,), mesh, spec)
