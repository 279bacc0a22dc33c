"""Pipeline schedules as pure functions: per-rank lists of compute actions.

An action is ``(kind, stage, microbatch)`` with kind ``F`` (forward), ``B`` (backward: input and
weight gradients, or only the input gradient under ZB-H1) or ``W`` (the weight gradient, ZB-H1 only).
``S = p * v`` stages sit round robin on the ``p`` ranks: stage ``j`` on rank ``j % p`` (``v`` > 1 only
for the interleaved schedule). The point-to-point actions between them are added by ``with_p2p``
(``compiler.pipeline.check``), which also checks the lists before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspec.errors import fail


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F", "B" or "W"
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


Lists = tuple[tuple[Action, ...], ...]


def rank_of(stage: int, p: int) -> int:
    return stage % p


def gpipe(p: int, m: int) -> Lists:
    """All forwards, then all backwards: m microbatches' activations live at once."""
    return tuple(
        tuple([Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]) for r in range(p)
    )


def one_f_one_b(p: int, m: int) -> Lists:
    """``p - r - 1`` warm-up forwards, then one forward and one backward in turn (PipeDream-flush):
    rank ``r`` holds at most ``p - r`` microbatches' activations."""
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", r, warm + i), Action("B", r, i)]
        acts += [Action("B", r, i) for i in range(m - warm, m)]
        out.append(tuple(acts))
    return tuple(out)


def interleaved(p: int, m: int, v: int) -> Lists:
    """Interleaved 1F1B (v stages per rank, round robin): forwards visit chunks in groups of ``p``
    microbatches, backwards the chunks in reverse; ``m`` must be a multiple of ``p``."""
    if m % p:
        raise fail(
            f"the interleaved schedule runs microbatches in groups of the pipeline size {p}, but "
            f"microbatches={m} is not a multiple of {p}.",
            f"use microbatches={max(p, m - m % p)} (a multiple of {p}), or schedule='1f1b'.",
        )
    total = m * v

    def fwd(r: int, k: int) -> Action:
        chunk = (k // p) % v
        return Action("F", chunk * p + r, (k // (p * v)) * p + k % p)

    def bwd(r: int, k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return Action("B", chunk * p + r, (k // (p * v)) * p + k % p)

    out = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [fwd(r, k) for k in range(warm)]
        for k in range(total - warm):
            acts += [fwd(r, warm + k), bwd(r, k)]
        acts += [bwd(r, k) for k in range(total - warm, total)]
        out.append(tuple(acts))
    return tuple(out)


def zb_h1(p: int, m: int) -> Lists:
    """ZB-H1: 1F1B's order of F and B, where B computes only the input gradient (what the previous
    stage waits for) and rank ``r`` runs each weight gradient W ``r`` backwards later, the last
    ``r`` of them in the drain, where 1F1B's ranks sit idle. With T_F = T_B = T_W the idle time
    per rank drops from 1F1B's 3(p - 1) to p - 1, with at most p microbatches in flight (until W)."""
    out = []
    for r, acts in enumerate(one_f_one_b(p, m)):
        lst: list[Action] = []
        backwards = weights = 0
        for a in acts:
            lst.append(a)
            if a.kind == "B":
                backwards += 1
                if backwards > r:
                    lst.append(Action("W", r, weights))
                    weights += 1
        lst += [Action("W", r, i) for i in range(weights, m)]
        out.append(tuple(lst))
    return tuple(out)


def _deps(a: Action, stages: int) -> list[Action]:
    """The actions ``a`` needs finished first (data dependencies of one microbatch)."""
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind == "B":
        after = [Action("B", a.stage + 1, a.mb)] if a.stage < stages - 1 else []
        return [Action("F", a.stage, a.mb), *after]
    return [Action("B", a.stage, a.mb)]


def deps(a: Action, stages: int) -> list[Action]:
    return _deps(a, stages)


def schedule(name: str, p: int, m: int, v: int = 1) -> Lists:
    """The per-rank action lists of schedule ``name`` for ``p`` ranks and ``m`` microbatches."""
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, v)
    if name == "zb-h1":
        return zb_h1(p, m)
    raise fail(f"no pipeline schedule {name!r}.", "use gpipe, 1f1b, interleaved or zb-h1.")
