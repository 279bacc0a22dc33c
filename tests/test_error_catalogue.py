"""Every case of the error catalogue raises a ShardingError that names what is wrong and the fix,
never prints tensor values, and docs/errors.md shows the messages the code produces today."""

from __future__ import annotations

import pathlib

import pytest

from tests import error_catalogue as cat

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def test_the_catalogue_is_large_enough():
    assert len(cat.CASES) + len(cat.REAL_CASES) >= 35
    assert len({c.category for c in cat.CASES}) >= 6


@pytest.mark.parametrize("case", cat.CASES, ids=[c.title for c in cat.CASES])
def test_case_raises_a_clear_error(case):
    msg = cat.message(case.run)
    assert msg, f"{case.title}: no ShardingError"
    assert "\nFix: " in msg, msg
    for fragment in case.says:
        assert fragment in msg, f"{case.title}: {fragment!r} not in\n{msg}"
    assert "tensor([" not in msg and len(msg) < 1500, msg


@pytest.mark.multiprocess
def test_real_mode_cases_and_the_page_is_current():
    real = cat.real_messages()
    for key, title, says in cat.REAL_CASES:
        assert "\nFix: " in real[key], (title, real[key])
        for fragment in says:
            assert fragment in real[key], (title, fragment, real[key])
    page = DOC.read_text()
    for case in cat.CASES:
        assert f"### {case.title}\n" in page, (
            f"docs/errors.md lacks {case.title!r}: run python -m tests.error_catalogue"
        )
    for _, title, _ in cat.REAL_CASES:
        assert f"### {title}\n" in page
