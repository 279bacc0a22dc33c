"""``Lowered``: what a compiled step will do, before it runs — program text, collectives, costs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from collectives import accounting
from collectives.ops import fake_rank
from compiler.passes import liveness
from compiler.passes.cast import AGAIN as CAST
from compiler.passes.graph import LAUNCHES
from compiler.passes.regather import AGAIN
from compiler.passes.remat import AGAIN as REMAT_AGAIN
from compiler.sharding import Sharding
from compiler.sources import source_of
from shardspec.errors import fail, shown
from shardspec.layout import local_shape
from shardspec.spec import P

if TYPE_CHECKING:
    from compiler.partition import Inserted
    from compiler.pipeline.report import PipelineSchedule
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
    # model states per rank (ZeRO's count): parameters and optimizer state the step carries, their
    # gradients as the update reads them, and compute copies of parameters (a bf16 cast of an fp32
    # master), each at the layout it is held in
    model_state_bytes_per_rank: int = 0
    state_bytes_per_rank: int = 0  # parameters + optimizer state (the carried arguments)
    grad_bytes_per_rank: int = 0
    compute_param_bytes_per_rank: int = 0
    # the largest live sum of activations alone (forward values computed from the batch, and
    # their recomputations by remat): what remat reduces
    activation_peak_bytes_per_rank: int = 0
    # modeled seconds of one step on the described machine (sharded(cost_model=...), else the
    # default CostModel): each launch by the ring formulas plus FLOPs over the device's rate
    modeled_time_s: float = 0.0
    modeled_comm_s: float = 0.0
    modeled_compute_s: float = 0.0


class Lowered:
    """The compiled plan of a step for one argument signature, before anything runs.

    Example::

        low = step.lower(params, state, x, y)
        print(low.explain())  # every collective, why, and your source line
        print(low.cost().comm_bytes_per_rank, low.cost().peak_memory_bytes_per_rank)
        print(low.as_text(rank=0))  # the per-rank program
    """

    def __init__(self, program: Program) -> None:
        self.program = program

    def _rank(self, rank: object) -> int:
        """``rank`` checked against the mesh (a report of a rank that does not exist is an error)."""
        size = self.program.mesh.size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise fail(
                f"rank {shown(rank)} is not a device of {self.program.mesh.describe()} "
                f"(ranks 0..{size - 1}).",
                f"pass a rank from 0 to {size - 1}.",
            )
        return rank

    def as_text(self, rank: int = 0) -> str:
        """The per-rank program (rank 0's unless told), collectives visible as shardspec ops."""
        rank = self._rank(rank)
        p = self.program
        head = [f"# per-rank program of rank {rank} on {p.mesh.describe()}"]
        for path, spec, info in zip(p.traced.in_paths, p.in_specs, p.traced.inputs, strict=True):
            head.append(
                f"#   {path}: global {info.shape} {spec} -> local "
                f"{local_shape(info.shape, p.mesh, spec, rank)}"
            )
        return "\n".join(head) + "\n" + p.programs[rank].code.strip() + "\n"

    def collectives(self) -> list[CollectiveInfo]:
        """One record per tensor moved (kind, axes, local shape, dtype, bytes per rank, reason, user
        line): the partitioner's, then the passes' re-gathers. Example::

            for c in step.lower(*args).collectives():
                print(c.kind, c.axes, c.bytes_per_rank, c.source)
        """
        again = [
            c
            for launch in self.launches()
            for c in launch
            if c.node.split(CAST)[0].endswith((AGAIN, REMAT_AGAIN))
        ]
        cast = {c.node.split(CAST)[0]: c for launch in self.launches() for c in launch if CAST in c.node}
        ran = {c.node.split(CAST)[0] for launch in self.launches() for c in launch}
        # a collective only backward used moves whole into a remat region's recomputation
        moved = [c for c in self.program.inserted if c.node not in ran and c.node + REMAT_AGAIN in ran]
        return [
            CollectiveInfo(c.kind, c.axes, c.shape, c.dtype, c.bytes_per_rank, c.reason, c.source)
            for c in (*(cast.get(c.node, c) for c in self.program.inserted if c not in moved), *again)
        ] + _p2p(self.program)

    def launches(self, rank: int = 0) -> list[list[Inserted]]:
        """The collectives as the program launches them, in order: a bucket is one launch of
        several inserted collectives (``collectives()`` lists each tensor moved, and why)."""
        rank = self._rank(rank)
        by_node = {c.node: c for c in self.program.inserted}
        for c in self.program.inserted:  # a parameter gathered again for backward (regather)
            by_node[c.node + AGAIN] = replace(
                c, reason=c.reason + "; gathered again for backward (regather)", node=c.node + AGAIN
            )
            by_node[c.node + REMAT_AGAIN] = replace(  # run again by a remat region's recomputation
                c, reason=c.reason + "; recomputed for backward (remat)", node=c.node + REMAT_AGAIN
            )
        out = []
        for n in self.program.programs[rank].graph.nodes:
            if n.op == "call_function" and n.target in LAUNCHES:
                names = n.meta.get("shardspec_members", [n.name])
                members = [_member(by_node, m) for m in names if m.split(CAST)[0] in by_node]
                if members:
                    out.append(members)
        if self.program.pipeline is None:  # (a stage program holds only its position's collectives)
            seen = {c.node.split(CAST)[0].removesuffix(REMAT_AGAIN) for launch in out for c in launch}
            out += [[c] for c in self.program.inserted if c.node not in seen]
        if self.program.pipeline is not None:  # then the sends of the rank's pipeline position
            from compiler.pipeline.report import p2p_launches

            axis = self.program.pipeline.pipeline.axis
            out += p2p_launches(self.program, self.program.mesh.axis_index(rank, axis))
        return out

    def cost(self) -> Cost:
        """What one call costs per rank: bytes sent (by the ring formulas, per launch), launches,
        peak memory (liveness over the scheduled program) and model-state bytes. Example::

            c = step.lower(*args).cost()
            print(c.comm_bytes_per_rank, c.collective_count, c.peak_memory_bytes_per_rank)
        """
        by_kind: dict[str, float] = {}
        total = 0.0
        from compiler.pipeline.report import p2p_seconds

        # the busiest rank's: a pipeline position (its collectives and sends), an uneven layout's
        # larger blocks
        firsts = list({id(gm): r for r, gm in reversed(list(enumerate(self.program.programs)))}.values())
        busiest = max(firsts, key=lambda r: sum(self._launch_bytes(ln) for ln in self.launches(r)))
        every = self.launches(busiest)
        launches = [ln for ln in every if ln[0].kind != "send"]
        sends = [ln for ln in every if ln[0].kind == "send"]
        for launch in launches + sends:
            sent = self._launch_bytes(launch)
            by_kind[launch[0].kind] = by_kind.get(launch[0].kind, 0.0) + sent
            total += sent
        peak = max(self.peak_memory(r) for r in firsts)
        carried, grads, compute = model_state(self.program)
        acts = max(self.activation_peak(r) for r in firsts)
        from compiler.plan.report import modeled_seconds

        comm_s, compute_s = modeled_seconds(
            self.program, ((ln[0].kind, ln[0].axes, self._launch_bytes(ln)) for ln in launches)
        )
        comm_s += p2p_seconds(self.program, sends)
        return Cost(
            total,
            len(launches) + len(sends),
            peak,
            by_kind,
            model_state_bytes_per_rank=carried + grads + compute,
            state_bytes_per_rank=carried,
            grad_bytes_per_rank=grads,
            compute_param_bytes_per_rank=compute,
            activation_peak_bytes_per_rank=acts,
            modeled_time_s=comm_s + compute_s,
            modeled_comm_s=comm_s,
            modeled_compute_s=compute_s,
        )

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
        return max(live for _, live in self.memory_profile(rank))

    def activation_peak(self, rank: int = 0) -> int:
        """Largest sum of live activation bytes: values computed in forward from the batch (the
        arguments the step does not carry), and their recomputations; not parameters, gathered
        parameters, gradients or optimizer values."""
        rank = self._rank(rank)
        return max(live for _, live in self.memory_profile(rank, _activations(self.program, rank)))

    def memory_profile(
        self, rank: int = 0, only: set[torch.fx.Node] | None = None
    ) -> list[tuple[torch.fx.Node | None, int]]:
        """Live tensor bytes after each op of the program (``None``: before the first op), by
        the liveness ``peak_memory`` takes the largest of (``only``: count just these buffers)."""
        p = self.program
        gm = p.programs[self._rank(rank)]
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [
            mode.from_tensor(torch.empty(local_shape(i.shape, p.mesh, s, rank), dtype=i.dtype))
            for i, s in zip(p.traced.inputs, p.in_specs, strict=True)
        ]
        with fake_rank(rank):  # collectives give this rank's blocks (an uneven layout's)
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
        return liveness.curve(gm, only)

    def pipeline_schedule(self) -> PipelineSchedule:
        """A pipelined step's action lists per position (with their sends and receives), the planned
        timeline and ``svg()`` of it (or of a measured ``compiler.pipeline.timeline.recording()``)."""
        from compiler.pipeline.report import pipeline_schedule

        return pipeline_schedule(self.program)

    def explain(self, summary: bool = False) -> str:
        """Every collective in the user's words (argument paths, gradients by parameter, source
        lines), grouped by line with totals per kind and axes; ``summary=True`` gives one line per
        kind and axes per source line. See ``compiler/explain.py``. Example::

            print(step.lower(params, state, x, y).explain())
        """
        from compiler.explain import explain

        return explain(self, summary=summary)


def _member(by_node: dict[str, Inserted], name: str) -> Inserted:
    """The record of a launch member; one the cast pass moved to another dtype, in that dtype."""
    base, _, dtype_name = name.partition(CAST)
    c = by_node[base]
    if not dtype_name:
        return c
    dtype = getattr(torch, dtype_name)
    scale = torch.empty((), dtype=dtype).element_size() / torch.empty((), dtype=c.dtype).element_size()
    return replace(c, dtype=dtype, bytes_per_rank=c.bytes_per_rank * scale, node=name)


def model_state(program: Program, rank: int = 0) -> tuple[int, int, int]:
    """ZeRO's model states on ``rank``, in bytes: (carried arguments, gradients, compute copies).

    Carried: a tensor argument the step returns a new value of (same global shape, dtype and
    spec: parameters, optimizer moments), at its input layout. Gradients: a value computed in
    backward that a forward-side op (the optimizer) reads, at the layout that op reads it (so a
    reduce-scattered gradient counts 1/N, an all-reduced one whole). Compute copies: a cast of a
    carried argument (``p.to(torch.bfloat16)``), at the layout propagation holds it in.
    """
    p, traced, mesh = program, program.traced, program.mesh
    placeholders = [n for n in traced.module.graph.nodes if n.op == "placeholder"]
    carried_nodes = {placeholders[i] for i in _carried(program)}
    carried = sum(
        _bytes(local_shape(traced.inputs[i].shape, mesh, p.in_specs[i], rank), traced.inputs[i].dtype)
        for i in _carried(program)
    )
    backward = {n for n in traced.module.graph.nodes if source_of(n).startswith("backward of ")}
    grads = compute = 0
    for n in traced.module.graph.nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        if n in backward:
            readers = [u for u in n.users if u not in backward and u.op == "call_function"]
            if readers:
                grads += _bytes(_held_shape(p, n, readers[0], rank), v.dtype)
        elif n.target in _CASTS and n.args and n.args[0] in carried_nodes and v.dtype != _dtype(n.args[0]):
            spec = p.prop.value[n].spec if isinstance(p.prop.value.get(n), Sharding) else P()
            compute += _bytes(local_shape(tuple(v.shape), mesh, spec, rank), v.dtype)
    return carried, grads, compute


def _carried(program: Program) -> list[int]:
    """Tensor inputs the step returns a new value of (same global shape, dtype and spec)."""
    traced = program.traced
    free = [(o.shape, o.dtype, s) for o, s in zip(traced.outputs, program.out_specs, strict=True)]
    out = []
    for i, (info, spec) in enumerate(zip(traced.inputs, program.in_specs, strict=True)):
        if (info.shape, info.dtype, spec) in free:
            free.remove((info.shape, info.dtype, spec))
            out.append(i)
    return out


def _activations(program: Program, rank: int) -> set[torch.fx.Node]:
    """Nodes of ``rank``'s program computed in forward from a non-carried argument (the batch),
    and their recomputations for backward (remat)."""
    gm = program.programs[rank]
    backward = {n.name for n in program.traced.module.graph.nodes if source_of(n).startswith("backward of ")}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    carried = {placeholders[i] for i in _carried(program)}
    acts: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        # a remat copy keeps its forward origin, so it counts as the value it recomputes
        if n.meta.get("shardspec_origin") not in backward and any(
            a in acts or (a.op == "placeholder" and a not in carried) for a in n.all_input_nodes
        ):
            acts.add(n)
    return acts


_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _dtype(n: object) -> torch.dtype | None:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _held_shape(p: Program, n: torch.fx.Node, reader: torch.fx.Node, rank: int) -> tuple[int, ...]:
    """Local shape of ``n`` as ``reader`` reads it (its required layout), else as propagated."""
    shape = tuple(n.meta["val"].shape)
    plan = p.prop.plans.get(reader)
    held = p.prop.value.get(n)
    if plan is not None and n in plan.operands:
        held = plan.required[plan.operands.index(n)]
    spec = held.spec if isinstance(held, Sharding) else P()
    return local_shape(shape, p.mesh, spec, rank)


def _p2p(program: Program) -> list[CollectiveInfo]:
    """A pipelined step's sends (``compiler.pipeline.report``)."""
    if program.pipeline is None:
        return []
    from compiler.pipeline.report import p2p_records

    return p2p_records(program)
