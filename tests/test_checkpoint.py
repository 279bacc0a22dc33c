"""shardspec.checkpoint: resharding across meshes and world sizes, atomic saves, fix-it errors.

Each resharding case trains the example MLP with @sharded on mesh A, saves, loads on mesh B with B's
specs, trains on, and compares with one uninterrupted unsharded run: the loaded values equal the
saved ones exactly (DCP copies bytes); the continued parameters agree to fp32 rounding, since a
different mesh sums gradients in a different order.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import optree
import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from shardspec import Mesh, P, ShardingError, checkpoint
from shardspec.checkpoint_files import LOCK
from shardspec.testing import run_distributed
from tests import _ckpt_fns as fns

A_STEPS, B_STEPS = 3, 6


def _names(root):
    """The root's entries, but the save lock."""
    return sorted(p.name for p in root.iterdir() if p.name != LOCK)


@pytest.fixture(scope="module", autouse=True)
def _warm(tmp_path_factory):
    """Compile once here so forked ranks inherit torch's lazily imported tracing machinery."""
    fns.train_phase(0, 1, "sim_zero3", str(tmp_path_factory.mktemp("warm")), 0, 1, False)


def _phase(layout, world, ckpt, start, stop, save):
    if layout.startswith("sim_"):
        return [fns.train_phase(0, 1, layout, ckpt, start, stop, save)]
    return run_distributed(fns.train_phase, world, args=(layout, ckpt, start, stop, save), timeout=120)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("a", "a_world", "b", "local_w1"),
    [
        ("dp4", 4, "dp2xtp2", (8, 8)),  # replicated -> columns split over tp
        ("zero3", 4, "dp4", (8, 16)),  # ZeRO-3 (split over dp) -> DP (replicated)
        ("tp2", 2, "tp4", (8, 4)),  # world 2 -> world 4
        ("sim_zero3", 1, "dp2xtp2", (8, 8)),  # one process (global tensors) -> 4 processes
        ("dp2xtp2", 4, "zero3", (2, 16)),  # a 2-d mesh with tensor parallelism -> ZeRO-3 over 4
    ],
)
def test_reshard_and_continue_matches_uninterrupted_run(tmp_path, a, a_world, b, local_w1):
    ckpt = str(tmp_path)
    saved = _phase(a, a_world, ckpt, 0, A_STEPS, True)
    resumed = _phase(b, 4, ckpt, A_STEPS, B_STEPS, False)
    want = fns.reference(B_STEPS)
    for rank, r in enumerate(resumed):
        assert r["local_w1"] == local_w1  # laid out by B's specs
        for k in want:
            assert torch.equal(r["loaded"][k], saved[0]["params"][k]), k
            torch.testing.assert_close(r["params"][k], want[k], rtol=1e-5, atol=1e-6)
        if rank < len(saved):  # the same rank's RNG stream continues where the save left it
            assert torch.equal(r["rng_after_load"], saved[rank]["rng_after_save"])
        else:  # ranks that did not exist at save time take rank 0's state
            assert torch.equal(r["rng_after_load"], saved[0]["rng_after_save"])
    # the same checkpoint in simulated mode (meta stand-ins for like): global tensors, exact
    like = optree.tree_map(
        lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, fns.fresh()
    )
    tree, step = checkpoint.load(ckpt, like=like, mesh=Mesh({"dp": 4}, simulate=True))
    assert step == A_STEPS and tree["model"] == "mlp"
    for k in want:
        assert torch.equal(tree["params"][k], saved[0]["params"][k])


def _tree(fill: float = 123.456) -> dict[str, object]:
    return {
        "params": {"w": torch.full((4, 3), fill), "b": torch.full((3,), fill)},
        "buffers": [torch.arange(5)],
        "epoch": 2,
    }


def _assert_same(got, want):
    g, w = optree.tree_leaves(got), optree.tree_leaves(want)
    assert len(g) == len(w)
    for x, y in zip(g, w):
        assert torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y


def _write_then(action):
    """A FileSystemWriter.write_data that writes this rank's data, then runs ``action``."""
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        future = original(self, plan, planner)
        future.wait()
        action()
        return future

    return write_data


def test_exception_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    first = _tree(1.0)
    checkpoint.save(tmp_path, first, step=1)

    def boom():
        raise RuntimeError("disk went away")

    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "write_data", _write_then(boom))
        # DCP collects every rank's failure; it is reported as a ShardingError naming each one
        with pytest.raises(ShardingError, match="rank 0: RuntimeError: disk went away"):
            checkpoint.save(tmp_path, _tree(2.0), step=2)
    assert (tmp_path / ".tmp-step-00000002").is_dir()  # data written, never published
    assert checkpoint.find(tmp_path) == tmp_path / "step-00000001"
    tree, step = checkpoint.load(tmp_path, like=_tree())
    assert step == 1
    _assert_same(tree, first)

    # the next save clears the debris and publishes; the previous checkpoint is kept (keep=2)
    checkpoint.save(tmp_path, _tree(2.0), step=2)
    names = _names(tmp_path)
    assert names == ["latest", "step-00000001", "step-00000002"]
    assert checkpoint.load(tmp_path, like=_tree()).step == 2
    checkpoint.save(tmp_path, _tree(3.0), step=3)
    assert not (tmp_path / "step-00000001").exists()
    # a dangling latest (e.g. crash while replacing a step) falls back to the newest complete one
    (tmp_path / "latest").write_text("step-00000009\n")
    assert checkpoint.load(tmp_path, like=_tree()).step == 3
    # loading an explicit checkpoint directory
    assert checkpoint.load(tmp_path / "step-00000002", like=_tree()).step == 2
    # saving a step again replaces it
    checkpoint.save(tmp_path, _tree(4.0), step=3)
    _assert_same(checkpoint.load(tmp_path, like=_tree()).tree, _tree(4.0))
    assert _names(tmp_path) == [
        "latest",
        "step-00000002",
        "step-00000003",
    ]


def _save_then_die(root: str) -> None:
    checkpoint.save(root, _tree(1.0), step=5)
    FileSystemWriter.write_data = _write_then(lambda: os.kill(os.getpid(), signal.SIGKILL))
    checkpoint.save(root, _tree(2.0), step=10)


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    proc = multiprocessing.get_context("fork").Process(target=_save_then_die, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL, f"child exited with {proc.exitcode}, expected SIGKILL"
    tree, step = checkpoint.load(tmp_path, like=_tree())
    assert step == 5
    _assert_same(tree, _tree(1.0))
    with pytest.raises(ShardingError, match="is incomplete"):
        checkpoint.load(tmp_path / ".tmp-step-00000010", like=_tree())


def _error(fn) -> str:
    with pytest.raises(ShardingError) as info:
        fn()
    message = str(info.value)
    assert "Fix:" in message and "123.4" not in message  # never tensor values
    return message


def test_load_errors_name_paths_shapes_dtypes_and_fix(tmp_path):
    checkpoint.save(tmp_path, _tree(), step=7)

    like = _tree()
    like["params"]["extra"] = like["params"].pop("b")
    msg = _error(lambda: checkpoint.load(tmp_path, like=like))
    assert "different trees" in msg and "step 7" in msg
    assert "in like but not in the checkpoint: tree['params']['extra']" in msg
    assert "in the checkpoint but not in like: tree['params']['b']" in msg

    like = _tree()
    like["params"]["w"] = torch.zeros(4, 5)
    msg = _error(lambda: checkpoint.load(tmp_path, like=like))
    assert "tree['params']['w'] has shape (4, 3) (float32)" in msg and "expects (4, 5)" in msg

    like = _tree()
    like["buffers"] = [torch.zeros(5, dtype=torch.int32)]
    msg = _error(lambda: checkpoint.load(tmp_path, like=like))
    assert "tree['buffers'][0] is int64" in msg and "expects int32 (shape (5,))" in msg

    like = _tree()
    like["epoch"] = torch.zeros(())
    msg = _error(lambda: checkpoint.load(tmp_path, like=like))
    assert "tree['epoch'] is a scalar" in msg


def test_missing_and_incomplete_checkpoint_errors(tmp_path):
    msg = _error(lambda: checkpoint.load(tmp_path / "nowhere", like=_tree()))
    assert "no checkpoint at" in msg and "does not exist" in msg
    msg = _error(lambda: checkpoint.load(tmp_path, like=_tree()))
    assert "no checkpoint at" in msg and "no step-N directory" in msg
    assert checkpoint.find(tmp_path) is None

    # the very first save crashed: only debris, reported as incomplete (and find -> None: start over)
    (tmp_path / ".tmp-step-00000004").mkdir()
    msg = _error(lambda: checkpoint.load(tmp_path, like=_tree()))
    assert "holds only incomplete checkpoints (.tmp-step-00000004)" in msg
    assert checkpoint.find(tmp_path) is None

    checkpoint.save(tmp_path / "b", _tree(), step=1)
    (tmp_path / "b" / "step-00000001" / "shardspec.json").unlink()
    msg = _error(lambda: checkpoint.load(tmp_path / "b" / "step-00000001", like=_tree()))
    assert "is incomplete: it lacks shardspec.json" in msg


def test_foreign_damaged_and_misplaced_checkpoints_are_errors_naming_the_fix(tmp_path):
    """A foreign record, a damaged shard file and specs that do not fit the mesh: each a
    ShardingError (DCP's own failure derives from BaseException, past ``except Exception``)."""
    import json

    ckpt = checkpoint.save(tmp_path, _tree(), step=1)
    record = json.loads((ckpt / "shardspec.json").read_text())
    (ckpt / "shardspec.json").write_text(json.dumps({**record, "format": "shardspec-checkpoint/99"}))
    assert "its format is 'shardspec-checkpoint/99'" in _error(lambda: checkpoint.load(ckpt, like=_tree()))
    (ckpt / "shardspec.json").write_text(json.dumps({"complete": True}))
    assert "is not a shardspec-checkpoint/1 record" in _error(lambda: checkpoint.load(ckpt, like=_tree()))

    ckpt = checkpoint.save(tmp_path / "b", _tree(), step=1)
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:10])
    msg = _error(lambda: checkpoint.load(ckpt, like=_tree()))
    assert "is damaged" in msg and ".distcp (CRC-32" in msg
    msg = _error(lambda: checkpoint.load(ckpt, like=_tree(), verify=False))  # DCP's own failure
    assert "torch.distributed.checkpoint failed on" in msg and "rank 0:" in msg

    ckpt = checkpoint.save(tmp_path / "c", _tree(), step=1)
    sim = Mesh({"dp": 2}, simulate=True)
    msg = _error(
        lambda: checkpoint.load(
            ckpt, like=_tree(), mesh=sim, specs={"params": P("tp"), "buffers": P(), "epoch": P()}
        )
    )
    assert "names mesh axis 'tp'" in msg


def test_save_errors(tmp_path):
    msg = _error(lambda: checkpoint.save(tmp_path, {"x": torch.ones(2), "f": object()}, step=1))
    assert "tree['f'] is a object" in msg
    assert "step must be a non-negative int" in _error(lambda: checkpoint.save(tmp_path, {}, step=-1))
    assert "keep >= 1" in _error(lambda: checkpoint.save(tmp_path, {}, step=1, keep=0))
    assert not list(Path(tmp_path).iterdir())  # nothing written for a rejected save


@pytest.mark.multiprocess
def test_ranks_that_disagree_get_the_same_error_and_nothing_is_written(tmp_path):
    results = run_distributed(fns.disagreements, 2, args=(str(tmp_path),), timeout=120)
    for r in results:
        for case in ("step", "shape", "keys"):
            assert "ranks passed different steps, paths, trees, shapes or dtypes" in r[case], r[case]
        assert "plain tensors or scalars differ across ranks" in r["values"] and "w" in r["values"]
        assert r["loaded"] == "2"
        assert "is float32 in" in r["all dtype"] and "like expects bfloat16" in r["all dtype"], r["all dtype"]
        assert "different trees" in r["all missing"], r["all missing"]
        assert "tree['w'] is a object" in r["all save"], r["all save"]
        assert "step-00000004 is damaged" in r["damaged"] and "__1_0.distcp (CRC-32" in r["damaged"]
    assert "rank(s) [1] rejected their arguments" in results[0]["load"], results[0]["load"]
    assert "have different trees; in like but not in the checkpoint: tree['v']" in results[1]["load"]
    assert _names(tmp_path) == ["latest", "step-00000002", "step-00000004"]


def test_a_resave_that_crashes_between_renames_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    import shardspec.checkpoint_files as files

    checkpoint.save(tmp_path, _tree(1.0), step=1, keep=1)
    real_rename = os.rename

    def rename(src, dst):
        real_rename(src, dst)
        if str(dst).endswith(".old-step-00000001"):
            raise OSError("killed between the renames")

    with monkeypatch.context() as m:
        m.setattr(files.os, "rename", rename)
        with pytest.raises(ShardingError):
            checkpoint.save(tmp_path, _tree(2.0), step=1, keep=1)
    # the old step 1 is complete, only moved aside: it still loads, and the next save restores it
    _assert_same(checkpoint.load(tmp_path, like=_tree()).tree, _tree(1.0))
    checkpoint.save(tmp_path, _tree(3.0), step=2, keep=2)
    assert _names(tmp_path) == [
        "latest",
        "step-00000001",
        "step-00000002",
    ]


def test_spec_mismatch_message_has_no_values(tmp_path):
    checkpoint.save(tmp_path, {"w": torch.randn(30, 30)}, step=1)
    with pytest.raises(ShardingError) as info:
        checkpoint.load(tmp_path, like={"w": torch.randn(30, 30)}, specs={"v": P()})
    assert "tensor(" not in str(info.value) and "specs do not match" in str(info.value)
    assert "['v']" in str(info.value) and "['w']" in str(info.value)  # the keys, not tree specs


def test_dict_specs_match_an_ordered_dict_by_key(tmp_path):
    """A state_dict is an OrderedDict in insertion order; a dict of specs flattens sorted: each
    entry still gets its own key's spec (they were paired by position)."""
    from collections import OrderedDict

    tree = OrderedDict([("weight", torch.randn(4, 6)), ("bias", torch.randn(6))])
    checkpoint.save(tmp_path, tree, step=1)
    mesh = Mesh({"tp": 2}, simulate=True)
    got = checkpoint.load(tmp_path, like=tree, specs={"weight": P(None, "tp"), "bias": P("tp")}, mesh=mesh)
    _assert_same(got.tree, tree)


def test_concurrent_saves_into_one_root_both_land_intact(tmp_path):
    """A save clears what crashed saves left: without the save lock it deleted another save's
    directory while that was being written, and returned an incomplete checkpoint."""
    import threading

    errors = []

    def save(step):
        try:
            checkpoint.save(tmp_path, _tree(float(step)), step=step, keep=None)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    for trial in range(6):
        steps = (2 * trial + 1, 2 * trial + 2)
        threads = [threading.Thread(target=save, args=(s,)) for s in steps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in steps:
            _assert_same(checkpoint.load(tmp_path / f"step-{s:08d}", like=_tree()).tree, _tree(float(s)))
    assert not errors


def test_damaged_checkpoints_are_reported_not_crashed_on(tmp_path):
    import os

    first = checkpoint.save(tmp_path, _tree(1.0), step=1)
    second = checkpoint.save(tmp_path, _tree(2.0), step=2)
    os.remove(second / "rng-0.pt")  # a checkpoint without a rank's RNG state is not complete
    assert checkpoint.find(tmp_path) == first
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00")  # a damaged pointer: the newest complete
    assert checkpoint.find(tmp_path) == first
    with pytest.raises(ShardingError, match=r"keep=1.5"):
        checkpoint.save(tmp_path, _tree(3.0), step=3, keep=1.5)
    assert not (tmp_path / "step-00000003").exists()  # refused before anything was written
    with pytest.raises(ShardingError, match=r"needs a shardspec\.Mesh"):
        checkpoint.load(tmp_path, like=_tree(), mesh="dp=2")


def test_a_flipped_bit_in_a_shard_file_is_an_error_naming_it_and_the_checkpoint_before(tmp_path):
    """DCP reads raw bytes: without the checksums the save records, a damaged shard file loads as
    silently wrong tensors (shown here with verify=False)."""
    first = checkpoint.save(tmp_path, _tree(1.0), step=1)
    second = checkpoint.save(tmp_path, _tree(2.0), step=2)
    shard = next(second.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    at = data.find(torch.full((3,), 2.0).numpy().tobytes())  # the raw bytes of a tensor of 2.0s
    assert at >= 0
    data[at] ^= 0x10  # a low mantissa bit of one element
    shard.write_bytes(bytes(data))
    msg = _error(lambda: checkpoint.load(tmp_path, like=_tree()))
    assert (
        f"{second} is damaged" in msg
        and shard.name in msg
        and f"load the previous checkpoint, {first}" in msg
    )
    unchecked = checkpoint.load(tmp_path, like=_tree(), verify=False).tree
    expected = _tree(2.0)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(optree.tree_leaves(unchecked), optree.tree_leaves(expected))
        if isinstance(a, torch.Tensor)
    )
    assert torch.equal(checkpoint.load(first, like=_tree()).tree["params"]["w"], _tree(1.0)["params"]["w"])
