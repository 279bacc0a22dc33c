"""Every Python block of README.md and docs/**/*.md runs as written.

A file's blocks run in order in one namespace (a later block may use an earlier one's names), in a
scratch directory. A block preceded by ``<!-- not run: <reason> -->`` is skipped; the reason must be
given (e.g. a snippet that only makes sense under torchrun).
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"(?:<!--\s*not run:(?P<reason>[^>]*)-->\s*\n)?```python\n(?P<code>.*?)```", re.S)


def blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, skip reason or None) for each Python block of a markdown file."""
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        reason = m.group("reason")
        found.append((line, m.group("code"), reason.strip() if reason is not None else None))
    return found


CASES = [p for p in FILES if blocks(p)]


@pytest.mark.parametrize("path", CASES, ids=[str(p.relative_to(ROOT)) for p in CASES])
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict[str, object] = {"__name__": "__markdown__"}
    ran = 0
    for line, code, reason in blocks(path):
        if reason is not None:
            assert reason, f"{path.name}:{line}: a skipped block must say why (<!-- not run: why -->)"
            continue
        # name the block by file and line, and register its text, so tracebacks and explain() show it
        name = f"{path.relative_to(ROOT)}:{line}"
        source = "\n" * (line - 1) + code
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(source, name, "exec"), namespace)
        ran += 1
    assert ran or all(r for _, _, r in blocks(path))


def test_every_markdown_file_is_checked():
    assert ROOT / "README.md" in CASES
    assert os.path.exists(ROOT / "docs")
