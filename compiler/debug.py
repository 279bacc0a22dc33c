"""Find where a sharded program first departs from the global one (a development and support tool).

Runs the traced global graph on the full arguments and every rank's program on its shards (simulated
mesh), then, in program order, rebuilds each original value from the ranks' local values — blocks
placed by the value's layout, pending sums added over their axes — and compares.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.fx import Interpreter

from collectives.simulated import run_simulated
from compiler.program import Program
from compiler.sharding import Sharding
from shardspec.layout import shard, unshard


class _Recorder(Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, by_origin: bool = True) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}
        self.by_origin = by_origin

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        origin = n.meta.get("shardspec_origin") if self.by_origin else n.name
        if origin is not None:  # a copy: later in-place collectives overwrite their operands
            self.values[origin] = optree.tree_map(
                lambda v: v.clone() if isinstance(v, torch.Tensor) else v, out, none_is_leaf=False
            )
        return out


def first_divergence(
    program: Program, args: tuple[Any, ...], rtol: float = 1e-4, atol: float = 1e-5
) -> str | None:
    """The first original node whose sharded value differs from the global run, or None."""
    mesh = program.mesh
    leaves: list[Any] = optree.tree_leaves(args, none_is_leaf=False)  # type: ignore[arg-type]
    tensors = [leaves[i] for i in program.traced.tensor_positions]
    glob = _Recorder(program.traced.module, by_origin=False)
    with torch.no_grad():
        glob.run(*tensors)
    pieces = [shard(t, mesh, s) for t, s in zip(tensors, program.in_specs, strict=True)]

    def body(rank: int) -> dict[str, Any]:
        rec = _Recorder(program.programs[rank])
        with torch.no_grad():
            rec.run(*[p[rank] for p in pieces])
        return rec.values

    per_rank = run_simulated(body, mesh)
    for node in program.traced.module.graph.nodes:
        s = program.prop.value.get(node)
        if node.op != "call_function" or not isinstance(s, Sharding) or node.name not in per_rank[0]:
            continue
        want = glob.values[node.name]
        got = _rebuild([r[node.name] for r in per_rank], s, mesh)
        same = got.shape == want.shape
        if not same or not torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol):
            diff = (got.double() - want.double()).abs().max().item() if same else None
            where = node.meta.get("stack_trace", "")
            return f"{node.name} = {node.target}, layout {s}, from {where}: " + (
                f"max abs diff {diff}" if same else f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
            )
    return None


def _rebuild(locals_: list[torch.Tensor], s: Sharding, mesh: Any) -> torch.Tensor:
    if s.partial:
        summed = []
        for rank in range(mesh.size):
            group = mesh.group_of(rank, s.partial)
            summed.append(sum(locals_[r] for r in group))
        locals_ = summed
    return unshard(locals_, mesh, s.spec)
