"""Run a script the way a user does: ``torchrun --standalone --nproc-per-node N ...`` in a fresh
process tree, with a deadline that kills torchrun and every worker it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun(
    nproc: int,
    target: list[str],
    *,
    cwd: Path = ROOT,
    timeout: float = 240,
    launcher: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[str, str]:
    """``target`` is ``["-m", module, *argv]`` or ``[script, *argv]``; returns (stdout, stderr)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        *launcher, *target,
    ]  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout:.0f} s; last output:\n{(out + err)[-4000:]}")
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}; last output:\n{(out + err)[-6000:]}"
    return out, err
