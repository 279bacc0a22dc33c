"""Restart with torchrun: a rank SIGKILLs itself, torchrun restarts the group, training resumes from
the newest complete checkpoint and ends with exactly the parameters of an uninterrupted run.

The uninterrupted run uses the same mesh, per-rank programs and collectives on 4 gloo processes, and
the data of each step depends on the step alone, so equality is bitwise (``torch.equal``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardspec.checkpoint_files import LOCK
from tests._torchrun import torchrun

pytestmark = pytest.mark.multiprocess
STEPS, EVERY = 6, 2
TRAIN = ["--mesh", "dp=2,tp=2", "--layers", "1", "--steps", str(STEPS)]
TIMEOUT = 240  # seconds for one torchrun invocation (two attempts) on a loaded 2-core machine


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ref") / "params.pt"
    torchrun(4, ["-m", "examples.train_gpt", *TRAIN, "--out", str(out)], cwd=out.parent, timeout=TIMEOUT)
    return torch.load(out)


def _torchrun(args: list[str], cwd: Path) -> str:
    """Run the example under torchrun (4 gloo workers, one restart allowed); return its output."""
    out, err = torchrun(
        4,
        ["-m", "examples.train_gpt", *args],
        cwd=cwd,
        timeout=TIMEOUT,
        launcher=("--max-restarts", "1", "--monitor-interval", "0.2"),
    )
    return out + err


def _check(output: str, out: Path, want: dict[str, torch.Tensor], resumed_at: int) -> None:
    assert "mode: real (dp=2 x tp=2: 4 processes, gloo, attempt 0)" in output
    assert "mode: real (dp=2 x tp=2: 4 processes, gloo, attempt 1)" in output, output[-4000:]
    assert f"(step {resumed_at})" in output.split("attempt 1)", 1)[1], output[-4000:]
    got = torch.load(out)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: max diff {(got[k] - want[k]).abs().max().item()}"


def test_killed_rank_restarts_and_matches_uninterrupted_run(tmp_path, uninterrupted):
    out, ckpt = tmp_path / "params.pt", tmp_path / "ckpt"
    args = [*TRAIN, "--ckpt", str(ckpt), "--ckpt-every", str(EVERY), "--out", str(out)]
    output = _torchrun([*args, "--kill-rank", "1", "--kill-step", "3"], tmp_path)
    assert "rank 1: killing myself (SIGKILL) before step 4" in output
    _check(output, out, uninterrupted, resumed_at=2)


def test_kill_during_save_resumes_from_previous_checkpoint(tmp_path, uninterrupted):
    out, ckpt = tmp_path / "params.pt", tmp_path / "ckpt"
    args = [*TRAIN, "--ckpt", str(ckpt), "--ckpt-every", str(EVERY), "--out", str(out)]
    output = _torchrun([*args, "--kill-step", "4", "--kill-during-save"], tmp_path)
    assert "rank 1: killing myself (SIGKILL) in the middle of a checkpoint save" in output
    _check(output, out, uninterrupted, resumed_at=2)  # step 4's partial save was never published
    names = sorted(p.name for p in ckpt.iterdir() if p.name != LOCK)  # (the save lock stays)
    assert names == ["latest", "step-00000004", "step-00000006"]
