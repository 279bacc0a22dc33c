import torch
from hypothesis import given
from hypothesis import strategies as st

from shardspec import Mesh, P, chunk_bounds, chunk_sizes, local_shape, shard, unshard
from shardspec.layout import device_slices, is_even
from tests.strategies import meshes, shapes, specs


@given(st.integers(0, 40), st.integers(1, 9))
def test_chunk_bounds_follow_torch_chunk(length, parts):
    chunks = torch.arange(length).chunk(parts) if length else ()
    sizes = chunk_sizes(length, parts)
    assert len(sizes) == parts and sum(sizes) == length
    assert sizes[: len(chunks)] == [len(c) for c in chunks]
    assert all(s == 0 for s in sizes[len(chunks) :])
    for i, c in enumerate(chunks):
        start, stop = chunk_bounds(length, parts, i)
        assert torch.equal(torch.arange(length)[start:stop], c)


@given(st.data())
def test_unshard_inverts_shard(data):
    mesh = data.draw(meshes())
    shape = data.draw(shapes())
    spec = data.draw(specs(mesh, len(shape)))
    x = torch.randn(shape) if shape else torch.randn(())
    pieces = shard(x, mesh, spec)
    assert len(pieces) == mesh.size
    for r, piece in enumerate(pieces):
        assert tuple(piece.shape) == local_shape(shape, mesh, spec, r)
    assert torch.equal(unshard(pieces, mesh, spec, check_replicas=True), x)


@given(st.data())
def test_blocks_tile_the_tensor_exactly_once(data):
    """Every element is held by exactly (devices / shards) devices: no drop, no duplicate block."""
    mesh = data.draw(meshes())
    shape = data.draw(shapes(max_ndim=2))
    spec = data.draw(specs(mesh, len(shape)))
    count = torch.zeros(shape, dtype=torch.int64)
    for r in range(mesh.size):
        count[device_slices(shape, mesh, spec, r)] += 1
    replication = mesh.size // mesh.axis_size(spec.axes) if spec.axes else mesh.size
    assert bool((count == replication).all())


def test_uneven_layout_matches_torch_chunk_and_allows_empty_shards():
    mesh = Mesh({"dp": 4}, simulate=True)
    x = torch.arange(6)
    pieces = shard(x, mesh, P("dp"))
    assert [p.tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5], []]
    assert not is_even((6,), mesh, P("dp"))


def test_tuple_entry_is_flat_split_first_axis_major():
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    x = torch.arange(8)
    assert [p.tolist() for p in shard(x, mesh, P(("dp", "tp")))] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [p.tolist() for p in shard(x, mesh, P(("tp", "dp")))] == [[0, 1], [4, 5], [2, 3], [6, 7]]


def test_shard_pieces_do_not_alias_the_input():
    mesh = Mesh({"dp": 2}, simulate=True)
    x = torch.zeros(4)
    shard(x, mesh, P("dp"))[0].fill_(1)
    assert x.sum() == 0


def test_check_replicas_catches_divergence():
    mesh = Mesh({"dp": 2}, simulate=True)
    pieces = shard(torch.ones(3), mesh, P())
    pieces[1] = pieces[1] + 1
    assert torch.equal(unshard(pieces, mesh, P()), torch.ones(3))
    try:
        unshard(pieces, mesh, P(), check_replicas=True)
    except ValueError as e:
        assert "rank 1 disagrees" in str(e)
    else:
        raise AssertionError("divergent replicas were accepted")
