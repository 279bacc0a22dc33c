"""What ``Lowered`` reports about a pipelined step: the P2P transfers as collectives, the stages and
their balance for ``explain()``, and ``pipeline_schedule()`` (action lists, planned or measured
timeline, and an SVG picture of it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from compiler.pipeline.boundary import BOUNDARY
from compiler.pipeline.check import Op, Timing, peak_in_flight, simulate
from compiler.pipeline.schedules import Lists

if TYPE_CHECKING:
    from compiler.lowered import CollectiveInfo
    from compiler.partition import Inserted
    from compiler.pipeline.split import P2P
    from compiler.program import Program

_COLORS = {"F": "#4e79a7", "B": "#59a14f", "W": "#f28e2b"}


def p2p_records(program: Program) -> list[CollectiveInfo]:
    """Every send of one pipeline group in a step, as ``Lowered.collectives()`` records."""
    from compiler.lowered import CollectiveInfo

    pp = program.pipeline
    if pp is None:
        return []
    return [
        CollectiveInfo(
            "send",
            (pp.pipeline.axis,),
            t.shape,
            t.dtype,
            float(t.bytes),
            f"{t.value} made by {t.producer} on position {t.src} is read by {t.consumer} on position {t.dst}",
            p2p_line(program, t),
        )
        for t in pp.per_rank[0].p2p
    ]


def p2p_line(program: Program, t: P2P) -> str:
    """The user line of the pipeline_boundary a sent value crosses (forward: the boundary reading
    it; backward: the boundary whose gradient it is), else the line that computed it."""
    from compiler.sources import source_of

    nodes = {n.name: n for n in program.traced.module.graph.nodes}
    n = nodes.get(t.origin)
    if n is None:
        return ""
    for u in (n, *n.users):
        if u.target is BOUNDARY and source_of(u):
            return source_of(u)
    return source_of(n)


def p2p_launches(program: Program, position: int | None = None) -> list[list[Inserted]]:
    """The sends of one pipeline position (``None``: the busiest) as one-tensor launches, the way
    ``Lowered.launches()`` lists collectives."""
    from compiler.partition import Inserted

    pp = program.pipeline
    if pp is None:
        return []
    if position is None:
        sent = [0.0] * pp.positions
        for t in pp.per_rank[0].p2p:
            sent[t.src] += t.bytes
        position = max(range(pp.positions), key=lambda q: sent[q])
    return [
        [
            Inserted(
                "send",
                (pp.pipeline.axis,),
                t.shape,
                t.dtype,
                float(t.bytes),
                f"activation{' gradient' if t.dst < t.src else ''} sent from position {t.src} to "
                f"position {t.dst} ({t.producer} -> {t.consumer})",
                p2p_line(program, t),
                f"p2p:{t.value}:{t.dst}",
            )
        ]
        for t in pp.per_rank[0].p2p
        if t.src == position
    ]


def p2p_seconds(program: Program, launches: list[list[Inserted]]) -> float:
    """Modeled seconds of the sends: one latency plus bytes over the axis's bandwidth each."""
    from compiler.plan.costmodel import CostModel

    pp = program.pipeline
    if pp is None or pp.positions <= 1:
        return 0.0
    model = program.cost_model if isinstance(program.cost_model, CostModel) else CostModel()
    axes = (pp.pipeline.axis,)
    lat, bw = model.axis_latency(axes), model.axis_bandwidth(axes)
    return sum(lat + launch[0].bytes_per_rank / bw for launch in launches)


def stage_lines(program: Program) -> list[str]:
    pp = program.pipeline
    if pp is None:
        return []
    st = pp.stages
    p = pp.positions
    lines = [
        f"pipeline over {pp.pipeline.axis!r}: {st.stages} stage(s) on {p} position(s), schedule "
        f"{pp.pipeline.schedule}, {st.microbatches} microbatch(es), cuts at boundaries {list(st.cuts)} of "
        f"{len(st.segment_cost) - 1}; balance (largest / mean stage cost) {st.balance:.2f}"
    ]
    for s, c in enumerate(st.stage_cost):
        lines.append(f"  stage {s} on position {s % p}: cost {c:.0f} (FLOPs + bytes per microbatch)")
    return lines


@dataclass(frozen=True)
class PipelineSchedule:
    """The action lists per pipeline position, with their P2P, and the planned timeline."""

    lists: Lists
    ops: tuple[tuple[Op, ...], ...]  # per position: compute keys, sends, recvs as the programs run them
    planned: Timing  # unit costs T_F = T_B = T_W = 1
    peak_in_flight: tuple[int, ...]

    @property
    def bubble(self) -> float:
        return self.planned.bubble

    def as_text(self) -> str:
        return "\n".join(
            f"position {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.lists)
        )

    def svg(
        self, measured: dict[int, list[tuple[str, float, float]]] | None = None, ranks: Any = None
    ) -> str:
        """The schedule as SVG: one row per position, a box per action (planned unit times, or the
        ``measured`` spans of ``timeline.recording()`` for the given ``ranks``, one per position)."""
        if measured is None:
            rows = [[(str(a), s, e) for a, s, e in span] for span in self.planned.spans]
        else:
            order = list(ranks) if ranks is not None else sorted(measured)
            rows = [measured.get(r, []) for r in order]
        end = max((e for row in rows for _, _, e in row), default=1.0) or 1.0
        width, height = 1000.0, 28.0
        scale = width / end
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 90:.0f}" '
            f'height="{height * len(rows) + 20:.0f}" font-family="monospace" font-size="10">'
        ]
        for r, row in enumerate(rows):
            y = 10 + r * height
            parts.append(f'<text x="2" y="{y + 17:.0f}">pos {r}</text>')
            for label, s, e in row:
                color = _COLORS.get(label[:1], "#999")
                parts.append(
                    f'<rect x="{80 + s * scale:.2f}" y="{y:.0f}" width="{max((e - s) * scale, 0.5):.2f}" '
                    f'height="{height - 4:.0f}" fill="{color}" stroke="white"><title>{label}</title></rect>'
                )
                if (e - s) * scale > 24:
                    parts.append(
                        f'<text x="{82 + s * scale:.2f}" y="{y + 16:.0f}" fill="white">{label}</text>'
                    )
        parts.append("</svg>")
        return "\n".join(parts)


def pipeline_schedule(program: Program) -> PipelineSchedule:
    pp = program.pipeline
    if pp is None:
        from shardspec.errors import fail

        raise fail(
            "pipeline_schedule(): this step was compiled without a pipeline.",
            "pass sharded(..., pipeline=shardspec.Pipeline(axis='pp', schedule='1f1b')).",
        )
    return PipelineSchedule(pp.lists, pp.per_rank[0].ops, simulate(pp.lists), tuple(peak_in_flight(pp.lists)))
