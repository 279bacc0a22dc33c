import pickle

import pytest

from shardspec import P


def test_trailing_nones_and_single_tuples_normalize():
    assert P("dp", None, None) == P("dp")
    assert P(("tp",)) == P("tp")
    assert P(()) == P(None) == P()
    assert hash(P("dp", None)) == hash(P("dp"))
    assert P(("dp", "tp"), None).entries == (("dp", "tp"),)


def test_list_entry_becomes_tuple():
    assert P(["dp", "tp"]) == P(("dp", "tp"))


def test_order_inside_tuple_matters():
    assert P(("dp", "tp")) != P(("tp", "dp"))


def test_accessors():
    p = P(None, ("dp", "tp"), "sp")
    assert len(p) == 3
    assert list(p) == [None, ("dp", "tp"), "sp"]
    assert p[1] == ("dp", "tp")
    assert p.axes == ("dp", "tp", "sp")
    assert p.axes_of(0) == () and p.axes_of(1) == ("dp", "tp") and p.axes_of(7) == ()
    assert p.padded(5) == (None, ("dp", "tp"), "sp", None, None)


def test_immutable_and_picklable():
    p = P("dp", None, "tp")
    with pytest.raises(AttributeError):
        p._entries = ()  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(p)) == p
    assert {p: 1}[P("dp", None, "tp")] == 1


def test_repr_is_constructor_form():
    assert repr(P("dp", None, ("x", "y"))) == "P('dp', None, ('x', 'y'))"
    assert eval(repr(P("dp", None, ("x", "y")))) == P("dp", None, ("x", "y"))


def test_a_spec_may_not_name_more_dims_than_its_value_has_trailing_nones_included():
    """As JAX's PartitionSpec: P(None, None) for a vector is a mistake, though it equals P()."""
    import torch

    from shardspec import Mesh, ShardingError, constrain, sharded

    mesh = Mesh({"dp": 2}, simulate=True)
    x = torch.randn(4)
    assert P(None, None) == P() and P("dp", None) == P("dp")
    for spec in (P(None, None), P("dp", None), P(None, "dp")):
        with pytest.raises(
            ShardingError, match=r"x: spec P\(.*\) has 2 entries but the value has shape \(4,\)"
        ):
            sharded(lambda x: x * 2, mesh=mesh, in_specs=(spec,), out_specs=P())(x)
        with pytest.raises(ShardingError, match="give at most 1 entry;"):
            sharded(lambda x, s=spec: constrain(x * 2, s), mesh=mesh, in_specs=(P(),), out_specs=P())(x)
    assert torch.equal(sharded(lambda x: x * 2, mesh=mesh, in_specs=(P("dp"),), out_specs=P(None))(x), x * 2)
