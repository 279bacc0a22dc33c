"""``Pipeline``: how ``sharded(..., pipeline=...)`` runs a step as pipeline stages.

The step's ``shardspec.pipeline_boundary`` calls cut the model; ``Pipeline(axis="pp")`` places one
stage per position along mesh axis ``pp`` (``virtual_stages=v`` places ``v`` stages per position,
round robin, for the interleaved schedule), and ``value_and_grad(..., microbatches=m)`` supplies
the microbatches the schedule interleaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspec.errors import fail, shown

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism over mesh axis ``axis`` with ``schedule`` (gpipe, 1f1b, interleaved,
    zb-h1); ``virtual_stages`` > 1 only with ``interleaved`` (which needs at least 2)."""

    axis: str = "pp"
    schedule: str = "1f1b"
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise fail(
                f"Pipeline(schedule={shown(self.schedule)}) is not a schedule.",
                f"use one of {', '.join(SCHEDULES)}.",
            )
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise fail(f"Pipeline(virtual_stages={shown(v)}) must be a positive int.", "pass e.g. 2.")
        if self.schedule == "interleaved" and v < 2:
            raise fail(
                f"Pipeline(schedule='interleaved', virtual_stages={v}): interleaving needs at least "
                "2 stages per rank.",
                "pass virtual_stages=2 (or more), or use schedule='1f1b'.",
            )
        if self.schedule != "interleaved" and v != 1:
            raise fail(
                f"Pipeline(schedule={shown(self.schedule)}, virtual_stages={v}): only the interleaved "
                "schedule places several stages per rank.",
                f"use schedule='interleaved' with virtual_stages={v}, or drop virtual_stages.",
            )
        if not isinstance(self.axis, str):
            raise fail(f"Pipeline(axis={shown(self.axis)}) must be a mesh axis name.", "pass e.g. axis='pp'.")
