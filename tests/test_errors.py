"""Each bad input gets a ShardingError naming what was wrong, the sizes, and the fix."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate

from shardspec import Mesh, P, ShardingError, placements_to_spec, shard, spec_to_placements, unshard

SIM = {"simulate": True}


def err(fn, *args, **kwargs) -> str:
    with pytest.raises(ShardingError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "\nFix: " in msg, msg
    return msg


def test_unknown_axis():
    mesh = Mesh({"dp": 2, "tp": 2}, **SIM)
    msg = err(shard, torch.zeros(4, 4), mesh, P("mp"), name="params['w1']")
    assert "params['w1']" in msg and "P('mp')" in msg and "'mp'" in msg
    assert "['dp', 'tp']" in msg and "dp=2 x tp=2" in msg


def test_axis_used_twice():
    msg = err(P, "dp", None, "dp")
    assert "'dp' twice" in msg and "dims 0 and 2" in msg and "tuple" in msg


def test_axis_twice_inside_tuple():
    msg = err(P, ("dp", "dp"))
    assert "'dp' twice" in msg


def test_duplicate_axis_names_in_mesh():
    msg = err(Mesh, [("dp", 2), ("dp", 4)], **SIM)
    assert "'dp' appears twice" in msg and "distinct" in msg


def test_non_positive_axis_size():
    msg = err(Mesh, {"dp": 0}, **SIM)
    assert "size 0" in msg and "'dp'" in msg and ">= 1" in msg


def test_non_integer_axis_size():
    msg = err(Mesh, {"dp": 2.0}, **SIM)
    assert "2.0" in msg and "float" in msg and "positive int" in msg
    assert "bool" in err(Mesh, {"dp": True}, **SIM)


def test_empty_mesh():
    assert "at least one axis" in err(Mesh, {}, **SIM)


def test_bad_axis_name():
    assert "not a valid name" in err(Mesh, {"": 2}, **SIM)
    assert "not a valid name" in err(Mesh, [(3, 2)], **SIM)


def test_axes_not_a_mapping_or_pairs():
    assert "dict of name -> size" in err(Mesh, 4, **SIM)
    assert "not a (name, size) pair" in err(Mesh, ["dp", "tp"], **SIM)


def test_spec_longer_than_tensor_rank():
    mesh = Mesh({"dp": 2, "tp": 2}, **SIM)
    msg = err(shard, torch.zeros(4), mesh, P("dp", None, "tp"), name="batch")
    assert "batch" in msg and "3 entries" in msg and "shape (4,)" in msg and "at most 1" in msg
    msg = err(shard, torch.tensor(1.0), mesh, P("dp"), name="loss")
    assert "P() for a scalar" in msg


def test_entry_of_wrong_type():
    msg = err(P, "dp", 2)
    assert "entry 1 is 2 of type int" in msg and "P('dp', None)" in msg
    assert "item 3" in err(P, ("dp", 3))


def test_spec_not_a_partition_spec():
    mesh = Mesh({"dp": 2}, **SIM)
    msg = err(shard, torch.zeros(4), mesh, "dp", name="x")
    assert "expected a partition spec P(...)" in msg and "P('dp')" in msg


def test_unshard_wrong_piece_count():
    mesh = Mesh({"dp": 2, "tp": 2}, **SIM)
    msg = err(unshard, [torch.zeros(2)] * 3, mesh, P("dp"))
    assert "3 pieces" in msg and "4 devices" in msg


def test_unshard_piece_of_wrong_shape():
    mesh = Mesh({"dp": 2}, **SIM)
    # (2,2) then (2,3) tiles no torch.chunk layout: a global 5 splits as 3 then 2.
    msg = err(unshard, [torch.zeros(2, 2), torch.zeros(2, 3)], mesh, P(None, "dp"))
    assert "rank 0 holds shape (2, 2)" in msg and "(2, 3)" in msg and "(2, 5)" in msg


def test_rank_out_of_range():
    mesh = Mesh({"dp": 2, "tp": 2}, **SIM)
    msg = err(mesh.coords, 4)
    assert "rank 4" in msg and "0..3" in msg


def test_simulated_mesh_has_no_rank_or_device_mesh():
    mesh = Mesh({"dp": 2}, **SIM)
    assert "virtual devices" in err(lambda: mesh.rank)
    assert "no torch DeviceMesh" in err(lambda: mesh.device_mesh)


def test_dtensor_cannot_express_reversed_tuple():
    mesh = Mesh({"dp": 2, "tp": 2}, **SIM)
    msg = err(spec_to_placements, P(("tp", "dp")), mesh, name="w")
    assert "w:" in msg and "('tp', 'dp')" in msg and "('dp', 'tp')" in msg


def test_partial_and_wrong_count_placements():
    mesh = Mesh({"dp": 2}, **SIM)
    assert "Partial" in err(placements_to_spec, [Partial()], mesh, 1)
    msg = err(placements_to_spec, [Replicate(), Replicate()], mesh, 1)
    assert "2 placements" in msg and "1 axes" in msg


def test_real_mode_without_launcher(monkeypatch):
    assert not dist.is_initialized()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    msg = err(Mesh, {"dp": 2, "tp": 2})
    assert "not initialized" in msg and "torchrun --nproc-per-node=4" in msg
    assert "simulate=True" in msg


def test_real_mode_without_distributed_support(monkeypatch):
    monkeypatch.setattr(dist, "is_available", lambda: False)
    msg = err(Mesh, {"dp": 2})
    assert "torch.distributed" in msg and "simulate=True" in msg


def test_world_size_mismatch_names_the_source(monkeypatch):
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    msg = err(Mesh, {"dp": 2, "tp": 2})
    assert "4 devices" in msg and "world size is 2" in msg
    assert "WORLD_SIZE environment variable" in msg and "product is 2" in msg
    assert not dist.is_initialized()  # rejected before joining anything
