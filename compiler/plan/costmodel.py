"""A described machine and the modeled time of a plan on it.

The planner compares whole-step plans in seconds, not bytes, so that a plan sending fewer bytes but
recomputing a full-batch product on every rank is priced for what it costs. One collective over a
group of ``n`` devices moving ``S`` bytes (the full buffer on one rank) takes, by the ring formulas::

    all_reduce      2 (n - 1) α + 2 (n - 1) / n · S / β
    reduce_scatter    (n - 1) α +   (n - 1) / n · S / β
    all_gather        (n - 1) α +   (n - 1) / n · S / β      (S: the gathered result)
    all_to_all        (n - 1) α +   (n - 1) / n · S / β

α is the axis's latency per ring step and β its bandwidth per device (bytes/s); a group over a tuple
of axes runs at the slowest member's bandwidth and latency. The bandwidth terms are the bytes per
rank that ``compiler/reshard.py`` already counts (``Step.bytes_per_rank``), so this module only adds
the latency steps and divides by β. Compute time is FLOPs / ``flops_per_s``: a contraction (matmul,
convolution, attention, any rule with a summed factor) counts ``2 · Π local factor sizes``, an
elementwise op one FLOP per output element, views and collectives none.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from compiler.reshard import Step
from compiler.rules.notation import Rule
from shardspec.errors import fail
from shardspec.mesh import Mesh

_RING_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}


def _number(name: str, val: object, *, positive: bool) -> None:
    """A finite real number, above 0 for a rate, at least 0 for a latency."""
    ok = isinstance(val, numbers.Real) and not isinstance(val, bool) and math.isfinite(val)
    if not ok or not (val > 0 if positive else val >= 0):  # type: ignore[operator]
        raise fail(
            f"CostModel({name}={val!r}) must be a finite number {'above' if positive else 'at least'} 0.",
            f"give {name} as a plain number ({'bytes or FLOP per second' if positive else 'seconds'}).",
        )


@dataclass(frozen=True)
class CostModel:
    """The machine a plan is priced on. ``bandwidth``/``latency`` map mesh axis names to bytes/s
    per device and seconds per ring step (axes not named use the defaults); ``flops_per_s`` is one
    device's sustained rate; ``memory_bytes`` (None: unlimited) bounds each device's held values.

    The defaults describe one accelerator node (NVLink-class links, a ~100 TFLOP/s device)."""

    bandwidth_bytes_per_s: float = 100e9
    latency_s: float = 10e-6
    flops_per_s: float = 100e12
    bandwidth: tuple[tuple[str, float], ...] | dict[str, float] = field(default=())
    latency: tuple[tuple[str, float], ...] | dict[str, float] = field(default=())
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        _number("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True)
        _number("flops_per_s", self.flops_per_s, positive=True)
        _number("latency_s", self.latency_s, positive=False)
        # accept dicts for readability; store tuples so the model stays hashable
        for name, positive in (("bandwidth", True), ("latency", False)):
            table = getattr(self, name)
            try:
                items = sorted(dict(table).items())
            except (TypeError, ValueError):
                raise fail(
                    f"CostModel({name}={table!r}) must map mesh axis names to numbers.",
                    f"write e.g. {name}={{'dp': {'25e9' if positive else '5e-6'}}}.",
                ) from None
            for axis, val in items:
                _number(f"{name}[{axis!r}]", val, positive=positive)
            object.__setattr__(self, name, tuple(items))
        m = self.memory_bytes
        if m is not None and (
            isinstance(m, bool) or not isinstance(m, numbers.Real) or not 0 <= m < math.inf
        ):
            raise fail(
                f"CostModel(memory_bytes={m!r}) must be a number of bytes >= 0, or None for no limit.",
                "write e.g. memory_bytes=16 * 2**30.",
            )

    def axis_bandwidth(self, axes: tuple[str, ...]) -> float:
        table = dict(self.bandwidth)
        return min((table.get(a, self.bandwidth_bytes_per_s) for a in axes), default=math.inf)

    def axis_latency(self, axes: tuple[str, ...]) -> float:
        table = dict(self.latency)
        return max((table.get(a, self.latency_s) for a in axes), default=0.0)

    def collective_s(self, kind: str, axes: tuple[str, ...], bytes_per_rank: float, mesh: Mesh) -> float:
        """Seconds of one collective whose ring-formula bytes per rank are ``bytes_per_rank``."""
        if kind not in _RING_STEPS:
            return 0.0  # a local slice
        n = mesh.axis_size(axes)
        if n <= 1:
            return 0.0
        steps = _RING_STEPS[kind] * (n - 1)
        return steps * self.axis_latency(axes) + bytes_per_rank / self.axis_bandwidth(axes)

    def steps_s(self, steps: list[Step], mesh: Mesh) -> float:
        return sum(self.collective_s(s.kind, s.axes, s.bytes_per_rank, mesh) for s in steps)

    def compute_s(self, flops: float) -> float:
        return flops / self.flops_per_s


def op_flops(rule: Rule, sizes: dict[str, int], split: dict[str, int], view: bool) -> float:
    """FLOPs of one op on the rank with the largest block: ``sizes`` are global factor lengths,
    ``split`` the number of blocks each factor is cut into."""
    if view:
        return 0.0
    local = {f: -(-n // max(1, split.get(f, 1))) for f, n in sizes.items()}
    if rule.reductions:
        return 2.0 * math.prod(local.get(f, 1) for f in rule.factors)
    out = [f for dims in rule.outputs[:1] for dim in dims for f in dim[:1]]
    return float(math.prod(local.get(f, 1) for f in out)) if out else 1.0


def describe(model: Any) -> str:
    """One line naming the machine, for explain()."""
    if not isinstance(model, CostModel):
        return "greedy propagation (no cost model)"
    mem = f", {model.memory_bytes / 2**30:.1f} GiB per device" if model.memory_bytes else ""
    return (
        f"{model.bandwidth_bytes_per_s / 1e9:g} GB/s, {model.latency_s * 1e6:g} us per ring step, "
        f"{model.flops_per_s / 1e12:g} TFLOP/s{mem}"
    )
