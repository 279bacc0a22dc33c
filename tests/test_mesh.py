import pickle

import pytest
from hypothesis import given

from shardspec import Mesh
from tests.strategies import meshes


def test_simulated_mesh_properties():
    m = Mesh({"dp": 2, "tp": 4}, simulate=True)
    assert m.axis_names == ("dp", "tp")
    assert m.shape == {"dp": 2, "tp": 4}
    assert m.size == 8
    assert m.axis_size("tp") == 4 and m.axis_size(("dp", "tp")) == 8
    assert m.coords(0) == {"dp": 0, "tp": 0}
    assert m.coords(5) == {"dp": 1, "tp": 1}
    assert m.simulated


def test_sequence_of_pairs_equals_dict():
    assert Mesh([("dp", 2), ("tp", 2)], simulate=True) == Mesh({"dp": 2, "tp": 2}, simulate=True)
    assert Mesh({"dp": 2, "tp": 2}, simulate=True) != Mesh({"tp": 2, "dp": 2}, simulate=True)


def test_groups_follow_row_major_layout():
    m = Mesh({"dp": 2, "tp": 2}, simulate=True)
    assert m.groups("tp") == [[0, 1], [2, 3]]
    assert m.groups("dp") == [[0, 2], [1, 3]]
    assert m.groups(("dp", "tp")) == [[0, 1, 2, 3]]
    assert m.groups(("tp", "dp")) == [[0, 2, 1, 3]]  # tp major: index = tp * 2 + dp
    assert m.group_of(3, "dp") == [1, 3]


@given(meshes())
def test_coords_rank_roundtrip(m):
    for r in range(m.size):
        assert m.rank_of(m.coords(r)) == r
        for axis in m.axis_names:
            assert m.group_of(r, axis)[m.axis_index(r, axis)] == r


def test_repr_and_str_are_readable():
    m = Mesh({"dp": 2, "tp": 4}, simulate=True)
    assert repr(m) == "Mesh({'dp': 2, 'tp': 4}, simulate=True)"
    text = str(m)
    assert text.splitlines()[0] == "Mesh dp=2 x tp=4 (8 simulated devices)"
    assert "tp=3" in text and "dp=1" in text
    assert text.splitlines()[-1].split() == ["dp=1", "4", "5", "6", "7"]


def test_three_axis_str_lists_every_rank():
    text = str(Mesh({"pp": 2, "dp": 2, "tp": 2}, simulate=True))
    assert "[pp=1]" in text
    assert all(str(r) in text for r in range(8))


def test_mesh_is_immutable_hashable_picklable():
    m = Mesh({"dp": 2}, simulate=True)
    with pytest.raises(AttributeError):
        m._axes = ()  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(m)) == m
    assert len({m, Mesh({"dp": 2}, simulate=True)}) == 1
