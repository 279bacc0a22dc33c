"""Point-to-point actions for a schedule, the checker that runs them symbolically before the real
run, and a timing simulator that gives a schedule's planned bubble.

``with_p2p`` places a SEND right after the action producing a value and a RECV before the action
that needs it. Sends never block (they post to a per-pair FIFO, as the simulated mailbox and the
batched ``isend`` on gloo do); a rank receives from a peer in the order that peer sent, taking
earlier arrivals first and holding them, so the FIFO can never hand a block the wrong tensor.
``check`` then runs every rank's list with blocking receives: each action must find its inputs
produced (locally) or received, every receive must name what the FIFO holds, and the run must finish
(no deadlock).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from compiler.pipeline.schedules import Action, Lists, deps, rank_of
from shardspec.errors import fail


@dataclass(frozen=True)
class Transfer:
    """One value sent between ranks: made by ``producer`` on ``src``, read by ``consumer`` on ``dst``."""

    item: Hashable
    producer: Hashable
    consumer: Hashable
    src: int
    dst: int


@dataclass(frozen=True)
class Op:
    kind: str  # "compute", "send" or "recv"
    what: Hashable  # the action (compute) or the transfer's item (send / recv)
    peer: int = -1


def transfers(lists: Lists, p: int) -> list[Transfer]:
    """The activations (F s -> F s+1) and activation gradients (B s -> B s-1) crossing ranks."""
    stages = 1 + max(a.stage for acts in lists for a in acts)
    out = []
    for acts in lists:
        for a in acts:
            if a.kind == "F" and a.stage < stages - 1:
                nxt = Action("F", a.stage + 1, a.mb)
                out.append(
                    Transfer(("act", a.stage, a.mb), a, nxt, rank_of(a.stage, p), rank_of(a.stage + 1, p))
                )
            if a.kind == "B" and a.stage > 0:
                nxt = Action("B", a.stage - 1, a.mb)
                out.append(
                    Transfer(("grad", a.stage, a.mb), a, nxt, rank_of(a.stage, p), rank_of(a.stage - 1, p))
                )
    return [t for t in out if t.src != t.dst]


def with_p2p(order: Sequence[Sequence[Hashable]], moves: Sequence[Transfer]) -> tuple[tuple[Op, ...], ...]:
    """Per-rank op lists: each rank's compute order with SENDs after producers and RECVs (in the
    sender's order per peer) before consumers."""
    by_producer: dict[Hashable, list[Transfer]] = {}
    for t in moves:
        by_producer.setdefault(t.producer, []).append(t)
    sends: list[list[Op]] = [[] for _ in order]
    channel: dict[tuple[int, int], list[Transfer]] = {}
    for r, acts in enumerate(order):
        for a in acts:
            sends[r].append(Op("compute", a))
            for t in by_producer.get(a, ()):
                if t.src != r:
                    raise fail(f"{t.item} is made on rank {r}, not {t.src}.", "report this as a bug.")
                sends[r].append(Op("send", t.item, t.dst))
                channel.setdefault((t.src, t.dst), []).append(t)
    needs: dict[Hashable, list[Transfer]] = {}
    for t in moves:
        needs.setdefault(t.consumer, []).append(t)
    out: list[tuple[Op, ...]] = []
    for r, ops in enumerate(sends):
        got: dict[tuple[int, int], int] = {}
        full: list[Op] = []
        for op in ops:
            if op.kind == "compute":
                for t in needs.get(op.what, ()):
                    queue = channel[(t.src, r)]
                    upto = queue.index(t)
                    for k in range(got.get((t.src, r), 0), upto + 1):
                        full.append(Op("recv", queue[k].item, t.src))
                    got[(t.src, r)] = max(got.get((t.src, r), 0), upto + 1)
            full.append(op)
        out.append(tuple(full))
    return tuple(out)


def check(
    ops: Sequence[Sequence[Op]],
    needs: Callable[[Hashable], Sequence[Hashable]],
    made: dict[Hashable, Hashable],
) -> None:
    """Run the op lists symbolically. ``needs(action)`` lists what an action reads (actions or
    items); ``made[item]`` is the action whose result an item carries. Raises on a missing input,
    a receive of the wrong item, or a deadlock."""
    pos = [0] * len(ops)
    have: list[set[Hashable]] = [set() for _ in ops]  # per rank: actions run here, items received
    fifo: dict[tuple[int, int], list[Hashable]] = {}
    taken: dict[tuple[int, int], int] = {}
    progress = True
    while progress:
        progress = False
        for r, lst in enumerate(ops):
            while pos[r] < len(lst):
                op = lst[pos[r]]
                if op.kind == "send":
                    if made[op.what] not in have[r]:
                        raise fail(f"rank {r} sends {op.what} before computing it.", "report this as a bug.")
                    fifo.setdefault((r, op.peer), []).append(op.what)
                elif op.kind == "recv":
                    q, k = fifo.get((op.peer, r), []), taken.get((op.peer, r), 0)
                    if k >= len(q):
                        break  # blocked until the peer sends
                    if q[k] != op.what:
                        raise fail(
                            f"rank {r} expects {op.what} from rank {op.peer} but the next message is {q[k]}.",
                            "report this as a bug.",
                        )
                    taken[(op.peer, r)] = k + 1
                    have[r].add(op.what)
                else:
                    missing = [d for d in needs(op.what) if d not in have[r]]
                    if missing:
                        raise fail(
                            f"rank {r} runs {op.what} before its input {missing[0]} is there.",
                            "report this as a bug.",
                        )
                    have[r].add(op.what)
                pos[r] += 1
                progress = True
    stuck = [
        f"rank {r} at {ops[r][pos[r]].kind} {ops[r][pos[r]].what}"
        for r in range(len(ops))
        if pos[r] < len(ops[r])
    ]
    if stuck:
        raise fail(f"the pipeline schedule deadlocks: {'; '.join(stuck)}.", "report this as a bug.")


def check_schedule(lists: Lists, p: int, m: int) -> tuple[tuple[Op, ...], ...]:
    """Every stage runs each microbatch's F (and B, W when split) once, on its rank, and the lists
    with their P2P run to the end; returns the op lists."""
    stages = 1 + max(a.stage for acts in lists for a in acts)
    split = any(a.kind == "W" for acts in lists for a in acts)
    kinds = ("F", "B", "W") if split else ("F", "B")
    want = {Action(k, s, i) for k in kinds for s in range(stages) for i in range(m)}
    seen = [a for acts in lists for a in acts]
    if len(seen) != len(set(seen)) or set(seen) != want:
        raise fail("the pipeline schedule does not run every action exactly once.", "report this as a bug.")
    for r, acts in enumerate(lists):
        if any(rank_of(a.stage, p) != r for a in acts):
            raise fail(f"rank {r}'s list holds another rank's stage.", "report this as a bug.")
    moves = transfers(lists, p)
    ops = with_p2p(lists, moves)
    items = {t.item: t.producer for t in moves}
    local = {(t.consumer, t.item) for t in moves}

    def needs(a: Hashable) -> list[Hashable]:
        assert isinstance(a, Action)
        out: list[Hashable] = []
        for d in deps(a, stages):
            item = ("act" if d.kind == "F" else "grad", d.stage, d.mb)
            out.append(item if (a, item) in local else d)
        return out

    check(ops, needs, items)
    return ops


@dataclass(frozen=True)
class Timing:
    spans: tuple[tuple[tuple[Action, float, float], ...], ...]  # per rank: (action, start, end)
    makespan: float
    bubble: float  # idle fraction of the ranks' time until the last action ends


def simulate(lists: Lists, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> Timing:
    """Unit-cost timing with free communication. A B without separate W costs ``t_b + t_w``."""
    stages = 1 + max(a.stage for acts in lists for a in acts)
    split = any(a.kind == "W" for acts in lists for a in acts)
    cost = {"F": t_f, "B": t_b if split else t_b + t_w, "W": t_w}
    end: dict[Action, float] = {}
    pos, free = [0] * len(lists), [0.0] * len(lists)
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in lists]
    while any(pos[r] < len(lists[r]) for r in range(len(lists))):
        moved = False
        for r, acts in enumerate(lists):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                ds = deps(a, stages)
                if any(d not in end for d in ds):
                    break
                start = max([free[r], *(end[d] for d in ds)])
                end[a] = free[r] = start + cost[a.kind]
                spans[r].append((a, start, end[a]))
                pos[r] += 1
                moved = True
        if not moved:
            raise fail("the pipeline schedule deadlocks in the timing simulation.", "report this as a bug.")
    makespan = max(free)
    busy = sum(e - s for sp in spans for _, s, e in sp)
    return Timing(tuple(tuple(s) for s in spans), makespan, 1 - busy / (len(lists) * makespan))


def peak_in_flight(lists: Lists) -> list[int]:
    """Per rank: the most microbatches whose forward ran and whose last backward action has not."""
    split = any(a.kind == "W" for acts in lists for a in acts)
    last = "W" if split else "B"
    out = []
    for acts in lists:
        live: set[tuple[int, int]] = set()
        peak = 0
        for a in acts:
            if a.kind == "F":
                live.add((a.stage, a.mb))
                peak = max(peak, len(live))
            elif a.kind == last:
                live.discard((a.stage, a.mb))
        out.append(peak)
    return out
