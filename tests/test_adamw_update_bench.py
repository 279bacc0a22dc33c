"""benchmarks/adamw_update.py runs in a bounded form and times all four updates (not their values)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import adamw_update


def test_adamw_update_benchmark_smoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["adamw_update", "--rounds", "2"])
    adamw_update.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("2 rounds")
    timed = [line for line in lines[1:] if "median" in line and "min" in line]
    assert len(timed) == 4 and any("adamw_multi_" in line for line in timed)
