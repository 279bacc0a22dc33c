"""The measured timeline: each pipeline action's start and end per rank, when recording is on.

Stage programs call ``mark(action, edge)`` around every action; ``recording()`` collects
those marks (wall-clock seconds since it began) for the calls made inside it, simulated meshes'
virtual ranks included.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

_LOCK = threading.Lock()
_ACTIVE: list[dict[int, list[tuple[str, str, float]]]] = []
_START: list[float] = []


def mark(action: str, edge: str) -> None:
    """Record ``edge`` ("start"/"end") of ``action`` on the calling rank if a recording is open."""
    if not _ACTIVE:
        return
    now = time.perf_counter()
    rank = _rank()
    with _LOCK:
        for rec, t0 in zip(_ACTIVE, _START, strict=True):
            rec.setdefault(rank, []).append((action, edge, now - t0))


def _rank() -> int:
    from collectives import simulated

    ctx = simulated.current()
    if ctx is not None:
        return ctx[1]
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def recording() -> Iterator[dict[int, list[tuple[str, float, float]]]]:
    """``with recording() as spans: step(...)`` -> ``spans[rank]`` = [(action, start, end), ...]."""
    raw: dict[int, list[tuple[str, str, float]]] = {}
    spans: dict[int, list[tuple[str, float, float]]] = {}
    with _LOCK:
        _ACTIVE.append(raw)
        _START.append(time.perf_counter())
    try:
        yield spans
    finally:
        with _LOCK:
            i = next(i for i, r in enumerate(_ACTIVE) if r is raw)
            _ACTIVE.pop(i)
            _START.pop(i)
        for rank, marks in raw.items():
            open_: dict[str, float] = {}
            out = spans.setdefault(rank, [])
            for action, edge, t in marks:
                if edge == "start":
                    open_[action] = t
                else:
                    out.append((action, open_.pop(action, t), t))
