"""``Lowered``: what a compiled step will do, before it runs — program text, collectives, costs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from collectives import accounting
from compiler.passes.graph import LAUNCHES, aliases_input
from compiler.passes.regather import AGAIN
from shardspec.layout import local_shape

if TYPE_CHECKING:
    from compiler.partition import Inserted
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
    collective_count: int  # launches: a bucket of several tensors is one
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
        """One record per tensor moved: the partitioner's, then the passes' re-gathers."""
        again = [c for launch in self.launches() for c in launch if c.node.endswith(AGAIN)]
        return [
            CollectiveInfo(c.kind, c.axes, c.shape, c.dtype, c.bytes_per_rank, c.reason, c.source)
            for c in (*self.program.inserted, *again)
        ]

    def launches(self, rank: int = 0) -> list[list[Inserted]]:
        """The collectives as the program launches them, in order: a bucket is one launch of
        several inserted collectives (``collectives()`` lists each tensor moved, and why)."""
        by_node = {c.node: c for c in self.program.inserted}
        for c in self.program.inserted:  # a parameter gathered again for backward (regather)
            by_node[c.node + AGAIN] = replace(
                c, reason=c.reason + "; gathered again for backward (regather)", node=c.node + AGAIN
            )
        out = []
        for n in self.program.programs[rank].graph.nodes:
            if n.op == "call_function" and n.target in LAUNCHES:
                names = n.meta.get("shardspec_members", [n.name])
                members = [by_node[m] for m in names if m in by_node]
                if members:
                    out.append(members)
        seen = {c.node for launch in out for c in launch}
        return out + [[c] for c in self.program.inserted if c.node not in seen]

    def cost(self) -> Cost:
        by_kind: dict[str, float] = {}
        total = 0.0
        launches = self.launches()
        for launch in launches:
            sent = self._launch_bytes(launch)
            by_kind[launch[0].kind] = by_kind.get(launch[0].kind, 0.0) + sent
            total += sent
        return Cost(total, len(launches), self.peak_memory(), by_kind)

    def _launch_bytes(self, launch: list[Inserted]) -> float:
        """Bytes per rank of one launch, by the formula the backend applies to the flat buffer."""
        if len(launch) == 1:
            return launch[0].bytes_per_rank
        first = launch[0]
        if first.kind != "all_reduce":  # phi * S: a sum of whole bytes, exact
            return sum(c.bytes_per_rank for c in launch)
        numel = sum(math.prod(c.shape) for c in launch)
        flat = torch.empty(numel, dtype=first.dtype, device="meta")
        return accounting.all_reduce_bytes(flat, self.program.mesh.axis_size(first.axes))

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
        # a view (or in-place result) adds no bytes; it keeps the buffer it aliases alive
        root: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in nodes:
            src = n.all_input_nodes[0] if n.all_input_nodes else None
            alias = n.op == "call_function" and src is not None and aliases_input(n)
            root[n] = root[src] if alias and src is not None and _shares_storage(n, src) else n
        last: dict[torch.fx.Node, int] = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last[root[a]] = i
        pos = {n: i for i, n in enumerate(nodes)}
        for n in nodes:  # an async collective reads its input until it is waited for
            if n.op == "call_function" and n.kwargs.get("async_op") and n.users:
                done = max(pos[u] for u in n.users)
                for a in n.all_input_nodes:
                    last[root[a]] = max(last[root[a]], done)
        outputs = {root[a] for a in nodes[-1].all_input_nodes}

        def size(n: torch.fx.Node) -> int:
            if root[n] is not n:
                return 0
            v = n.meta.get("val")
            vals = v if isinstance(v, (tuple, list)) else [v]
            return sum(t.numel() * t.element_size() for t in vals if isinstance(t, torch.Tensor))

        free_at: dict[int, set[torch.fx.Node]] = {}
        for a, i in last.items():
            if a.op != "placeholder" and a not in outputs:
                free_at.setdefault(i, set()).add(a)
        live = sum(size(n) for n in nodes if n.op == "placeholder")
        peak = live
        for i, n in enumerate(nodes):
            if n.op in ("call_function", "get_attr"):
                live += size(n)
                peak = max(peak, live)
            live -= sum(size(a) for a in free_at.get(i, ()))
        return peak

    def explain(self) -> str:
        """Each launch: kind, axes, bytes per rank; for each tensor in it, why and the user line."""
        launches = self.launches()
        c = self.cost()
        moved = sum(len(launch) for launch in launches)
        lines = [
            f"{len(launches)} collective launch(es) moving {moved} tensor(s), "
            f"{c.comm_bytes_per_rank:.0f} bytes sent per rank, "
            f"peak memory {c.peak_memory_bytes_per_rank} bytes per rank "
            f"on {self.program.mesh.describe()}"
        ]
        for i, launch in enumerate(launches, 1):
            r = launch[0]
            dtype = str(r.dtype).replace("torch.", "")
            sent = self._launch_bytes(launch)
            if len(launch) == 1:
                lines.append(
                    f"[{i}] {r.kind} over {','.join(r.axes)}: local {r.shape} {dtype}, {sent:.0f} B/rank"
                )
                lines.append(f"    why: {r.reason}")
                lines.append(f"    at:  {r.source or '<no user line recorded>'}")
                continue
            lines.append(
                f"[{i}] {r.kind} over {','.join(r.axes)}: one bucket of {len(launch)} {dtype} tensors, "
                f"{sent:.0f} B/rank"
            )
            for m in launch:
                lines.append(f"    - local {m.shape}")
                lines.append(f"      why: {m.reason}")
                lines.append(f"      at:  {m.source or '<no user line recorded>'}")
        for note in self.program.prop.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _shares_storage(n: torch.fx.Node, src: torch.fx.Node) -> bool:
    """Whether a may-alias op really returned a view: ``reshape`` of a non-contiguous input copies,
    which the fake values' storages show."""
    a, b = n.meta.get("val"), src.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return True
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)
