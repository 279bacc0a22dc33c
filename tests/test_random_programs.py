"""Property: a random program (forward and gradients of a loss built from its outputs) run through
``sharded`` on a random simulated mesh with random input, output and gradient specs equals the eager
run. Wrong answers and internal exceptions fail; a ``ShardingError`` (no rule, refused by design) is
counted when compiling raises it (at run time it is an internal error), and the share of refused
programs is bounded so the property cannot pass vacuously."""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import optree
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from compiler.debug import first_divergence
from shardspec import ShardingError
from tests.random_programs import Case, cases

MAX_REFUSED = 0.25  # share of programs the compiler may refuse with a ShardingError
RTOL, ATOL = 1e-6, 1e-8  # float64


def run_case(case: Case) -> str:
    """``"ok"``, ``"refused: <reason>"`` or ``"degenerate"``; raises AssertionError on a wrong answer
    or an internal exception, with a runnable reproducer in the message."""
    ns = case.namespace()
    args = (ns["floats"], ns["others"], ns["cots"])
    want = ns["step"](*args)
    if not all(torch.isfinite(t).all() for t in optree.tree_leaves(want)):
        return "degenerate"
    f = ns["f"]
    try:  # compiling may refuse (no rule, refused by design); once compiled, any exception is ours
        f.lower(*args)
    except ShardingError as e:
        return "refused: " + str(e).splitlines()[0][:120]
    except Exception as e:
        raise AssertionError(
            f"internal exception {type(e).__name__}: {e}\n{traceback.format_exc()}\n{_report(case)}"
        ) from e
    try:
        got = f(*args)
    except Exception as e:
        raise AssertionError(
            f"internal exception {type(e).__name__}: {e}\n{traceback.format_exc()}\n{_report(case)}"
        ) from e
    for i, (a, b) in enumerate(zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True)):
        try:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as e:
            where = _divergence(f, args)
            raise AssertionError(
                f"wrong answer in result leaf {i} (outputs, then loss and gradients): {e}\n"
                f"first divergence: {where}\n{_report(case)}"
            ) from None
    return "ok"


def _divergence(f: Any, args: tuple[Any, ...]) -> str:
    try:
        return str(first_divergence(f._program(args)[0], args, rtol=RTOL, atol=ATOL))
    except Exception as e:
        return f"(first_divergence raised {type(e).__name__}: {e})"


def _report(case: Case) -> str:
    return f"ops: {case.program.ops}\n--- reproducer ---\n{case.script()}"


def test_random_programs_match_eager() -> None:
    outcomes: Counter[str] = Counter()

    @settings(deadline=None)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        case = data.draw(cases(), label="case")
        note(case.script())
        result = run_case(case)
        outcomes[result.split(":")[0]] += 1
        if result.startswith("refused"):
            reasons[result] += 1

    reasons: Counter[str] = Counter()
    prop()
    total = sum(outcomes.values())
    summary = f"{dict(outcomes)}; refusals: {reasons.most_common()}"
    print(summary)
    assert outcomes["ok"] > 0, summary
    assert outcomes["refused"] <= MAX_REFUSED * total, summary
