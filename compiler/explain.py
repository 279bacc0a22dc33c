"""``Lowered.explain()``: every collective of a step in the user's words, grouped by source line.

A collective is named by what it moves as the user knows it: an argument by its pytree path
(``params['h.0.mlp.fc.weight']``), a gradient by the parameter it is the gradient of, anything else
by the line that computed it; and it is filed under the line it belongs to: a gradient reduction
under the forward line that uses the weight, a parameter gather under the line that reads it, a
pending sum under the line that produced it. Totals are given per kind and axes.

Bytes are what the busiest rank sends, counted in whole elements: a ring all-reduce of ``numel``
elements over ``n`` ranks splits them into ``n`` chunks (torch.chunk sizes) and each rank sends all
but one chunk twice (reduce-scatter, then all-gather), so it sends ``2 * (numel - smallest chunk)``
elements: ``2 (n - 1) / n * S`` bytes when ``n`` divides ``numel`` and, e.g., 8 bytes (not 6) for a
4-byte scalar over 4 ranks. All-gathers and reduce-scatters send ``(n - 1) * largest block``, as
counted by the backends. A bucket (several tensors in one launch) is counted as its one flat
buffer; each member is shown with its share of that launch by size, in whole elements (so the
members' figures may differ from the launch's total by a few elements).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from compiler.passes.regather import AGAIN as REGATHER
from compiler.passes.remat import AGAIN as REMAT
from compiler.sources import source_of
from shardspec.layout import chunk_sizes

if TYPE_CHECKING:
    from compiler.lowered import Lowered
    from compiler.partition import Inserted

_BACKWARD = "backward of "
_USER_OPS = {
    "mm": "matmul",
    "bmm": "matmul",
    "addmm": "matmul",
    "to_copy": "cast",
    "view": "reshape",
    "unsafe_view": "reshape",
    "native_layer_norm": "layer_norm",
    "log_softmax": "log_softmax",
}
_PASS_THROUGH = ("view", "reshape", "t", "permute", "transpose", "expand", "_to_copy", "clone", "alias")


@dataclass(frozen=True)
class Item:
    """One tensor moved, in the user's words."""

    kind: str
    axes: tuple[str, ...]
    line: str  # the source line it is filed under
    what: str  # what moves, e.g. "gradient of params['w1']"
    why: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    launch: int


def ring_all_reduce_bytes(numel: int, itemsize: int, n: int) -> int:
    """Bytes the busiest rank sends in a ring all-reduce of whole elements (see the module doc)."""
    if n <= 1 or numel == 0:
        return 0
    return 2 * (numel - min(chunk_sizes(numel, n))) * itemsize


def human_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def short_line(source: str) -> str:
    """``/abs/dir/file.py:12: code`` with the path relative to the working directory."""
    if source.startswith(_BACKWARD):
        return _BACKWARD + short_line(source[len(_BACKWARD) :])
    path, sep, rest = source.partition(":")
    if sep and os.path.isabs(path):
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    return path + sep + rest


class _Namer:
    """User-level names for the global graph's values."""

    def __init__(self, lowered: Lowered) -> None:
        program = lowered.program
        self.graph = program.traced.module.graph
        self.nodes = {n.name: n for n in self.graph.nodes}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.paths: dict[Node, str] = dict(zip(placeholders, program.traced.in_paths, strict=False))
        self.value = program.prop.value
        self.by_line: dict[str, list[Node]] = {}
        for n in self.graph.nodes:
            self.by_line.setdefault(source_of(n), []).append(n)

    def root_input(self, n: Node) -> Node | None:
        """The argument ``n`` is a view/cast of, if any."""
        while n.op == "call_function":
            name = str(n.target).replace("aten.", "").split(".")[0]
            tensors = n.all_input_nodes
            if not name.startswith(_PASS_THROUGH) or len(tensors) != 1:
                return None
            n = tensors[0]
        return n if n in self.paths else None

    def roots(self, nodes: Sequence[Node]) -> list[Node]:
        """The arguments ``nodes`` read (through views and casts), in order."""
        out: list[Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                root = self.root_input(a)
                if root is not None and root not in out:
                    out.append(root)
        return out

    def parameter_of(self, grad: Node, forward_line: str, consumer: Node | None) -> str | None:
        """The argument whose gradient ``grad`` is: the one the forward line reads with the same
        shape (or, failing that, the same number of elements); among several (a norm's weight and
        bias), the one the consumer (the optimizer's update) also reads."""
        roots = self.roots(self.by_line.get(forward_line, []))
        for same in (_shape, _numel):
            found = [r for r in roots if same(r) == same(grad)]
            # by size alone only where the consumer reads that argument too (the update does, past
            # the views reshaping the gradient to the parameter's shape): an activation's gradient
            # may have as many elements as a weight of its line
            if consumer is not None and (len(found) > 1 or same is _numel):
                reader = consumer
                while reader.target in _RESHAPES and len(reader.users) == 1:
                    reader = next(iter(reader.users))
                if reader.op != "output":  # (a gradient the step returns: as it is)
                    # the update reading it (past reshapes), else one a few ops on (p - lr * g)
                    near = [r for r in found if r in self.roots([reader])]
                    found = near or [r for r in found if r in self.roots(self.downstream(reader))]
            if len(found) == 1:
                return self.paths[found[0]]
        return None

    def downstream(self, n: Node, depth: int = 4) -> list[Node]:
        """The ops within ``depth`` steps after ``n`` (an update ``p - lr * g`` reads the
        parameter two ops on)."""
        seen: list[Node] = []
        frontier = [n]
        for _ in range(depth):
            frontier = [u for f in frontier for u in f.users if u.op == "call_function" and u not in seen]
            seen += frontier
        return seen

    def op(self, n: Node) -> str:
        """The op as a user writes it (``mm`` -> ``matmul``, ``_to_copy`` -> ``cast``)."""
        if not isinstance(n.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return getattr(n.target, "__name__", str(n.target))
        name = str(n.target).split(".")
        base = (name[1] if name[0] in ("aten", "shardspec") and len(name) > 1 else name[0]).lstrip("_")
        return _USER_OPS.get(base, base)


_RESHAPES = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims,
    torch.ops.aten.unsqueeze.default,
}


def _shape(n: Node) -> tuple[int, ...] | None:
    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _numel(n: Node) -> int:
    v = n.meta.get("val")
    return int(v.numel()) if isinstance(v, torch.Tensor) else -1


def describe(lowered: Lowered, launches: Sequence[Sequence[Inserted]] | None = None) -> list[Item]:
    """Every tensor moved, launch by launch, named and filed in the user's words."""
    namer = _Namer(lowered)
    items = []
    for i, launch in enumerate(lowered.launches() if launches is None else launches, 1):
        for c in launch:
            items.append(_item(namer, c, i))
    return items


def _item(namer: _Namer, c: Inserted, launch: int) -> Item:
    value = namer.nodes.get(c.value)
    consumer = namer.nodes.get(c.consumer)
    over = ",".join(c.axes)
    line = c.source
    again = " again for backward" if REGATHER in c.node or REMAT in c.node else ""
    if c.kind == "send":  # a pipeline send: the activation (or its gradient) crossing a boundary
        return Item(c.kind, c.axes, line, c.reason.split(" sent")[0], c.reason, c.shape, c.dtype, launch)
    if value is None:  # a record without structure: keep the compiler's own words
        return Item(c.kind, c.axes, line, "a value", c.reason, c.shape, c.dtype, launch)
    src = source_of(value)
    current = namer.value.get(value)
    layout = str(current) if current is not None else "?"
    needed = (
        f"{namer.op(consumer)} at {short_line(source_of(consumer)).split(': ', 1)[0]}"
        if consumer is not None
        else "the step's result"
    )
    if value in namer.paths:
        what = namer.paths[value]
        if c.kind == "all_gather":
            why = f"stored split ({layout}); {needed} reads it whole{again}"
        else:
            why = f"passed as {layout}; {needed} needs it laid out differently"
        return Item(c.kind, c.axes, line, what, why, c.shape, c.dtype, launch)
    root = namer.root_input(value)
    if root is not None and c.kind == "all_gather":  # an argument through views (F.linear's w.t())
        why = f"{namer.paths[root]} is stored split; {needed} reads it whole{again}"
        what = f"{namer.paths[root]} (via {namer.op(value)})"
        return Item(c.kind, c.axes, line, what, why, c.shape, c.dtype, launch)
    if src.startswith(_BACKWARD):
        forward = src[len(_BACKWARD) :]
        param = namer.parameter_of(value, forward, consumer)
        reduces = current is not None and current.partial and c.kind in ("all_reduce", "reduce_scatter")
        if param is not None and reduces:
            how = "summed" if c.kind == "all_reduce" else f"summed and split over {over} (ZeRO)"
            why = f"a partial sum over {over} (each device holds its part); the update needs it {how}"
            return Item(c.kind, c.axes, forward, f"gradient of {param}", why, c.shape, c.dtype, launch)
        what = f"gradient of {param}" if param else "an activation's gradient (backward of this line)"
        if reduces:
            why = f"a partial sum over {over} (each device summed its own block); {needed} needs the total"
        else:
            why = f"it is {layout}; {needed} needs it moved"
        return Item(c.kind, c.axes, forward, what, why, c.shape, c.dtype, launch)
    shape = tuple(value.meta["val"].shape)
    what = f"the {namer.op(value)} result" + (f" {shape}" if shape else " (a scalar)")
    grad = _scaled_gradient(value)  # an update's lr * g, reduced after the scaling
    if grad is not None:
        param = namer.parameter_of(grad, source_of(grad)[len(_BACKWARD) :], consumer)
        what = f"gradient of {param} (after its {namer.op(value)} by a number)" if param else what
    if current is not None and current.partial and c.kind in ("all_reduce", "reduce_scatter"):
        why = f"a partial sum over {over} (each device summed its own block); {needed} needs the total"
        return Item(c.kind, c.axes, src or line, what, why, c.shape, c.dtype, launch)
    verb = {"all_gather": "whole", "all_to_all": "split along another dim"}.get(c.kind, "moved")
    why = f"it is {layout}; {needed} needs it {verb}"
    return Item(c.kind, c.axes, line, what, why, c.shape, c.dtype, launch)


def _scaled_gradient(value: Node) -> Node | None:
    """The backward value ``value`` scales by a number (``lr * g``, ``g / k``), if it does."""
    n = value
    for _ in range(4):
        if n.op != "call_function" or len(n.all_input_nodes) != 1 or n.target not in _SCALINGS:
            return None
        n = n.all_input_nodes[0]
        if source_of(n).startswith(_BACKWARD):
            return n
    return None


_SCALINGS = {
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.div.Tensor,
    torch.ops.aten.neg.default,
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
    *_RESHAPES,
}


def launch_bytes(launch: Sequence[Inserted], n: int) -> float:
    """Bytes the busiest rank sends for one launch (a bucket is one flat buffer)."""
    first = launch[0]
    if first.kind == "all_reduce":
        numel = sum(math.prod(c.shape) for c in launch)
        return ring_all_reduce_bytes(numel, first.dtype.itemsize, n)
    return sum(c.bytes_per_rank for c in launch)


def explain(lowered: Lowered, summary: bool = False) -> str:
    """The report ``Lowered.explain()`` returns (``summary``: one line per kind and axes per
    source line instead of one per tensor)."""
    program = lowered.program
    mesh = program.mesh
    launches = lowered.launches()
    pp = program.pipeline
    if pp is not None:  # every position's sends (rank 0's program launches only its own)
        from compiler.pipeline.report import p2p_launches

        launches = [ln for ln in launches if ln[0].kind != "send"]
        launches += [ln for q in range(pp.positions) for ln in p2p_launches(program, q)]
    sizes = [launch_bytes(launch, mesh.axis_size(launch[0].axes)) for launch in launches]
    items = describe(lowered, launches)
    cost = lowered.cost()
    count, tensors, sent_total = len(launches), len(items), sum(sizes)
    if pp is not None:  # per rank: the busiest position's sends, as cost() counts them
        busiest = [ln for ln in lowered.launches() if ln[0].kind != "send"]
        count = cost.collective_count
        tensors = sum(len(ln) for ln in busiest) + count - len(busiest)
        sent_total = cost.comm_bytes_per_rank
    lines = [
        f"{mesh.describe()} ({mesh.size} devices): {count} collective launch(es) moving "
        f"{tensors} tensor(s), {human_bytes(sent_total)} sent per rank, peak memory "
        f"{human_bytes(cost.peak_memory_bytes_per_rank)} per rank"
        + (" (the busiest pipeline position; every position's sends are listed)" if pp is not None else "")
    ]
    if not items:
        lines.append("no communication: every op runs on the blocks each device already holds")
    groups: dict[str, list[Item]] = {}
    for it in items:
        groups.setdefault(it.line, []).append(it)
    per_member = {}
    for launch, size in zip(launches, sizes, strict=True):
        total = sum(math.prod(c.shape) for c in launch) or 1
        for c in launch:  # a bucket member's share of its launch, in whole elements
            share = size * math.prod(c.shape) / total
            per_member[id(c)] = (
                round(share / c.dtype.itemsize) * c.dtype.itemsize if len(launch) > 1 else share
            )
    member_bytes = [per_member[id(c)] for launch in launches for c in launch]
    for line, group in groups.items():
        lines.append("")
        lines.append(short_line(line) if line else "<no user line recorded>")
        sent = {id(it): b for it, b in zip(items, member_bytes, strict=True)}
        if summary:
            kinds: dict[tuple[str, tuple[str, ...]], list[Item]] = {}
            for it in group:
                kinds.setdefault((it.kind, it.axes), []).append(it)
            for (kind, axes), its in kinds.items():
                names = ", ".join(dict.fromkeys(it.what for it in its))
                b = sum(sent[id(it)] for it in its)
                lines.append(f"  {kind} over {','.join(axes)} x{len(its)}, {human_bytes(b)}: {names}")
            continue
        for it in group:
            dtype = str(it.dtype).replace("torch.", "")
            lines.append(
                f"  [{it.launch}] {it.kind} over {','.join(it.axes)}: {it.what}, local {it.shape} {dtype}, "
                f"{human_bytes(sent[id(it)])}"
            )
            lines.append(f"      {it.why}")
    totals: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for launch, size in zip(launches, sizes, strict=True):
        t = totals.setdefault((launch[0].kind, launch[0].axes), [0, 0, 0.0])
        t[0] += 1
        t[1] += len(launch)
        t[2] += size
    if totals:
        lines.append("")
        lines.append("totals by kind and axes:")
        for (kind, axes), (n, k, b) in totals.items():
            where = "in one pipeline group (all positions)" if kind == "send" else "per rank"
            lines.append(
                f"  {kind} over {','.join(axes)}: {n:.0f} launch(es), {k:.0f} tensor(s), "
                f"{human_bytes(b)} {where}"
            )
    for note in program.prop.notes:
        lines.append(f"note: {note}")
    if program.pipeline is not None:
        from compiler.pipeline.report import stage_lines

        lines += stage_lines(program)
    return "\n".join(lines)
