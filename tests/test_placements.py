import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from shardspec import Mesh, P, ShardingError, placements_to_spec, spec_to_placements
from tests.strategies import meshes, specs


def test_simple_specs():
    m = Mesh({"dp": 2, "tp": 2}, simulate=True)
    assert spec_to_placements(P("dp", "tp"), m) == (Shard(0), Shard(1))
    assert spec_to_placements(P(None, "dp"), m) == (Shard(1), Replicate())
    assert spec_to_placements(P(), m) == (Replicate(), Replicate())
    assert spec_to_placements(P(("dp", "tp")), m) == (Shard(0), Shard(0))
    one = Mesh({"dp": 2, "tp": 1}, simulate=True)  # a size-1 axis may come in any order
    assert spec_to_placements(P(("tp", "dp")), one) == (Shard(0), Shard(0))


@given(st.data())
def test_round_trip_for_mesh_ordered_specs(data):
    mesh = data.draw(meshes())
    ndim = data.draw(st.integers(0, 3))
    spec = data.draw(specs(mesh, ndim))
    order = {a: i for i, a in enumerate(mesh.axis_names)}

    def in_order(axes):
        return list(axes) == sorted(axes, key=order.__getitem__)

    ordered = all(in_order(spec.axes_of(d)) for d in range(ndim))
    # a size-1 axis splits nothing: out of order, it is the same layout as in mesh order
    splitting = all(in_order([a for a in spec.axes_of(d) if mesh.shape[a] > 1]) for d in range(ndim))
    if ordered:
        assert placements_to_spec(spec_to_placements(spec, mesh), mesh, ndim) == spec
    elif splitting:
        sorted_spec = P(*(tuple(sorted(spec.axes_of(d), key=order.__getitem__)) or None for d in range(ndim)))
        assert placements_to_spec(spec_to_placements(spec, mesh), mesh, ndim) == sorted_spec
    else:
        with pytest.raises(ShardingError, match="mesh order"):
            spec_to_placements(spec, mesh)


def test_uneven_multi_axis_split_is_checked_against_nested_chunking():
    m = Mesh({"dp": 2, "tp": 2}, simulate=True)
    assert spec_to_placements(P(("dp", "tp")), m, shape=(8,)) == (Shard(0), Shard(0))
    # 5 over 2x2: flat blocks 2,2,1,0 but DTensor nests 3 -> (2,1) and 2 -> (1,1).
    with pytest.raises(ShardingError, match="unevenly"):
        spec_to_placements(P(("dp", "tp")), m, shape=(5,))
    # 6 over 2x2: flat blocks 2,2,2,0; nested 3 -> (2,1), 3 -> (2,1): different.
    with pytest.raises(ShardingError, match="unevenly"):
        spec_to_placements(P(("dp", "tp")), m, shape=(6,))
    # uneven over a single axis is fine: both are torch.chunk.
    assert spec_to_placements(P("dp"), m, shape=(5,)) == (Shard(0), Replicate())


def test_partial_has_no_spec():
    m = Mesh({"dp": 2}, simulate=True)
    with pytest.raises(ShardingError, match="Partial"):
        placements_to_spec([Partial()], m, 2)
