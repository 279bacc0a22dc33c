"""The planner's compile work, counted (not timed: a loaded machine would make timing flaky): the
integer program grows by the same amount per identical layer, and simple ops merged into their
producers add no variables (docs/planner.md: Measured, for the timings)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import compile_time
from compiler.plan import solve
from examples.models import gpt
from shardspec import CostModel

SMALL = {"vocab": 32, "seq": 8, "d": 16, "heads": 2}


def _program(layers: int, monkeypatch: pytest.MonkeyPatch) -> solve.Problem:
    """The integer program the planner solves for a ``layers``-deep GPT step (data parallel)."""
    seen: list[solve.Problem] = []
    original = solve.Problem.solve

    def recording(self: solve.Problem, time_limit_s: float) -> Any:
        seen.append(self)
        return original(self, time_limit_s)

    monkeypatch.setattr(solve.Problem, "solve", recording)
    _, args, f = compile_time.gpt_step(gpt.Config(layers=layers, **SMALL), 4)
    f.cost_model = CostModel()  # the same step, planned
    f.lower(*args)
    monkeypatch.setattr(solve.Problem, "solve", original)
    assert seen
    return seen[0]


def test_program_grows_linearly_in_depth_and_merged_ops_have_no_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one, two, three = (_program(n, monkeypatch) for n in (1, 2, 3))
    sizes = [len(p.cost) for p in (one, two, three)]
    assert sizes[2] - sizes[1] == sizes[1] - sizes[0] > 0  # each identical layer adds the same
    assert two.follows  # views and unary ops ride on their producers' variables
    assert not set(two.follows) & set(two.choice)
