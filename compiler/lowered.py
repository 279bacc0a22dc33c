"""``Lowered``: what a compiled step will do, before it runs — program text, collectives, costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from shardspec.layout import local_shape

if TYPE_CHECKING:
    from compiler.program import Program


@dataclass(frozen=True)
class CollectiveInfo:
    kind: str
    axes: tuple[str, ...]
    shape: tuple[int, ...]  # the local tensor sent into the collective
    dtype: torch.dtype
    bytes_per_rank: float
    reason: str
    source: str


@dataclass(frozen=True)
class Cost:
    comm_bytes_per_rank: float
    collective_count: int
    peak_memory_bytes_per_rank: int
    bytes_by_kind: dict[str, float]


class Lowered:
    """The compiled plan of a step for one argument signature."""

    def __init__(self, program: Program) -> None:
        self.program = program

    def as_text(self, rank: int = 0) -> str:
        """The per-rank program (rank 0's unless told), collectives visible as shardspec ops."""
        p = self.program
        head = [f"# per-rank program of rank {rank} on {p.mesh.describe()}"]
        for path, spec, info in zip(p.traced.in_paths, p.in_specs, p.traced.inputs, strict=True):
            head.append(
                f"#   {path}: global {info.shape} {spec} -> local "
                f"{local_shape(info.shape, p.mesh, spec, rank)}"
            )
        return "\n".join(head) + "\n" + p.programs[rank].code.strip() + "\n"

    def collectives(self) -> list[CollectiveInfo]:
        return [
            CollectiveInfo(c.kind, c.axes, c.shape, c.dtype, c.bytes_per_rank, c.reason, c.source)
            for c in self.program.inserted
        ]

    def cost(self) -> Cost:
        records = self.collectives()
        by_kind: dict[str, float] = {}
        for c in records:
            by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.bytes_per_rank
        return Cost(sum(c.bytes_per_rank for c in records), len(records), self.peak_memory(), by_kind)

    def peak_memory(self, rank: int = 0) -> int:
        """Largest sum of live tensor bytes over the program: arguments held throughout,
        intermediates from definition to last use, results to the end."""
        p = self.program
        gm = p.programs[rank]
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [
            mode.from_tensor(torch.empty(local_shape(i.shape, p.mesh, s, rank), dtype=i.dtype))
            for i, s in zip(p.traced.inputs, p.in_specs, strict=True)
        ]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
        nodes = list(gm.graph.nodes)
        last: dict[torch.fx.Node, int] = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last[a] = i
        outputs = set(nodes[-1].all_input_nodes)

        def size(n: torch.fx.Node) -> int:
            v = n.meta.get("val")
            vals = v if isinstance(v, (tuple, list)) else [v]
            return sum(t.numel() * t.element_size() for t in vals if isinstance(t, torch.Tensor))

        live = sum(size(n) for n in nodes if n.op == "placeholder")
        peak = live
        for i, n in enumerate(nodes):
            if n.op in ("call_function", "get_attr"):
                live += size(n)
                peak = max(peak, live)
            for a in n.all_input_nodes:
                if last.get(a) == i and a.op != "placeholder" and a not in outputs:
                    live -= size(a)
        return peak

    def explain(self) -> str:
        """Each collective: kind, axes, bytes per rank, why, and the user line behind it."""
        records = self.collectives()
        c = self.cost()
        lines = [
            f"{len(records)} collective(s), {c.comm_bytes_per_rank:.0f} bytes sent per rank, "
            f"peak memory {c.peak_memory_bytes_per_rank} bytes per rank "
            f"on {self.program.mesh.describe()}"
        ]
        for i, r in enumerate(records, 1):
            dtype = str(r.dtype).replace("torch.", "")
            lines.append(
                f"[{i}] {r.kind} over {','.join(r.axes)}: local {r.shape} {dtype}, "
                f"{r.bytes_per_rank:.0f} B/rank"
            )
            lines.append(f"    why: {r.reason}")
            lines.append(f"    at:  {r.source or '<no user line recorded>'}")
        for note in self.program.prop.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)
