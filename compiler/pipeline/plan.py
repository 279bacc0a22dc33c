"""Compile-side glue: stage assignment, the schedule, and each rank's stage program."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch.fx import GraphModule

from collectives.ops import fake_rank, mesh_key
from compiler.passes.graph import annotate
from compiler.passes.remat import Regions
from compiler.pipeline.boundary import BOUNDARY
from compiler.pipeline.check import check_schedule
from compiler.pipeline.schedules import Lists, schedule
from compiler.pipeline.split import StageProgram, split_program
from compiler.pipeline.stages import StagePlan, assign
from shardspec.errors import fail
from shardspec.mesh import Mesh
from shardspec.pipeline import Pipeline
from shardspec.spec import P


@dataclass(frozen=True)
class PipelinePlan:
    pipeline: Pipeline
    stages: StagePlan
    lists: Lists  # per pipeline position: its compute actions in order
    per_rank: tuple[StageProgram, ...]  # per mesh rank

    @property
    def positions(self) -> int:
        return len(self.lists)


def check_pipeline(pipeline: Pipeline, mesh: Mesh, specs: Sequence[tuple[str, P]]) -> None:
    """The axis exists and no spec splits over it (the pipeline owns it)."""
    if not isinstance(pipeline, Pipeline):
        raise fail(
            f"sharded(pipeline=...) needs a shardspec.Pipeline, got {type(pipeline).__name__}.",
            "pass pipeline=shardspec.Pipeline(axis='pp', schedule='1f1b').",
        )
    if pipeline.axis not in mesh.axis_names:
        raise fail(
            f"Pipeline(axis={pipeline.axis!r}) is not an axis of the mesh {mesh.describe()}.",
            f"add it to the mesh (Mesh({{'{pipeline.axis}': 2, ...}})) or name one of "
            f"{list(mesh.axis_names)}.",
        )
    for path, spec in specs:
        if pipeline.axis in spec.axes:
            raise fail(
                f"{path} has spec {spec}, which splits over the pipeline axis {pipeline.axis!r}.",
                f"leave {pipeline.axis!r} out of the specs: the pipeline places each stage's values on its "
                "own positions along it.",
            )


def check_pipeline_layouts(pipeline: Pipeline, graph: torch.fx.Graph, value: dict[Any, Any]) -> None:
    """No value of a pipelined step is laid out over the pipeline axis: each position along it
    computes other stages' values, so a block (or a pending addend) there would be one never
    computed. ``constrain(x, P(pp, ...))`` inside the step is the way to ask for one."""
    from compiler.constrain import decode
    from compiler.propagate_state import CONSTRAIN
    from compiler.sharding import Sharding
    from compiler.sources import source_of

    nodes = sorted(graph.nodes, key=lambda n: n.target is not CONSTRAIN)  # name a constrain first
    for n in nodes:
        held = value.get(n)
        held = held if isinstance(held, (tuple, list)) else (held,)
        if not any(isinstance(h, Sharding) and pipeline.axis in (*h.axes, *h.partial) for h in held):
            continue
        line = source_of(n)
        what = (
            f"constrain(..., {decode(str(n.kwargs['spec']))})"
            if n.target is CONSTRAIN
            else f"a value ({n.name})"
        )
        raise fail(
            f"{what}{' at ' + line if line else ''} splits over the pipeline axis {pipeline.axis!r}.",
            f"leave {pipeline.axis!r} out of the specs: the pipeline places each stage's values on its "
            "own positions along it.",
        )


def microbatches_of(module: GraphModule) -> int:
    from compiler.grad import MICROBATCH

    seen = [int((n.meta.get("custom") or {}).get(MICROBATCH, -1)) for n in module.graph.nodes]
    return 1 + max(seen, default=-1)


def _boundaries_inside(module: GraphModule, m: int) -> None:
    """Every pipeline_boundary runs inside the microbatched loss (a boundary elsewhere, on the
    batch in the step, cuts nothing the schedule runs and would shift the others' numbers)."""
    from compiler.grad import MICROBATCH
    from compiler.sources import source_of

    for n in module.graph.nodes:
        if n.target is BOUNDARY and int((n.meta.get("custom") or {}).get(MICROBATCH, -1)) < 0:
            raise fail(
                f"pipeline_boundary at {source_of(n) or n.name} runs outside "
                f"value_and_grad(loss_fn, microbatches={m}): a pipeline cuts only the loss function "
                "the microbatches run.",
                "move that pipeline_boundary into the loss function, between two groups of layers "
                "(or remove it); the step's other code runs outside the stages.",
            )


def plan_pipeline(
    pipeline: Pipeline,
    mesh: Mesh,
    traced_module: GraphModule,
    programs: Sequence[GraphModule],
    local_inputs: Sequence[Sequence[tuple[Sequence[int], torch.dtype]]],
    passes: Any = None,
    backward: frozenset[str] = frozenset(),
    remat: Regions | None = None,
) -> PipelinePlan:
    p = mesh.axis_size(pipeline.axis)
    m = microbatches_of(traced_module)
    if m == 0:
        raise fail(
            "sharded(pipeline=...) schedules microbatches, but the step takes no gradients with "
            "shardspec.value_and_grad.",
            "compute loss and gradients with "
            "shardspec.value_and_grad(loss_fn, microbatches=m)(params, batch).",
        )
    _boundaries_inside(traced_module, m)
    stages = assign(traced_module, p * pipeline.virtual_stages, m, pipeline.virtual_stages)
    lists = schedule(pipeline.schedule, p, m, pipeline.virtual_stages)
    check_schedule(lists, p, m)
    key = mesh_key(mesh)
    done: dict[tuple[int, int], StageProgram] = {}
    per_rank = []
    for r in range(mesh.size):
        q = mesh.axis_index(r, pipeline.axis)
        k = (id(programs[r]), q)
        if k not in done:
            with fake_rank(r):  # an uneven block's shapes are this rank's own (recv sizes, passes)
                annotate(programs[r], local_inputs[r])
                split = split_program(programs[r], stages, lists, q, pipeline.axis, key)
                module = _optimized(split.module, local_inputs[r], passes, backward, remat)
                done[k] = replace(split, module=module)
        per_rank.append(done[k])
    return PipelinePlan(pipeline, stages, lists, tuple(per_rank))


def _optimized(
    gm: GraphModule,
    inputs: Sequence[tuple[Sequence[int], torch.dtype]],
    passes: Any,
    backward: frozenset[str],
    remat: Regions | None,
) -> GraphModule:
    """The program passes on a stage program: views, remat (each microbatch's region recomputed
    just before that microbatch's backward block on this stage), in-place reductions and overlap
    (the DP reduction issued async once its gradients are complete, waited at the optimizer). Not
    regather, nor bucketing: its sinking moved a send after later blocks, which deadlocked the
    schedule."""
    from compiler import passes as program_passes

    opts = program_passes.options(passes)
    off: dict[str, Any] = {f.name: False for f in fields(opts) if f.name in ("regather", "bucket")}
    return program_passes.optimize(gm, inputs, replace(opts, **off), backward, remat)


def drop_boundaries(gm: GraphModule) -> GraphModule:
    """Without a pipeline a boundary is an identity: remove it from the per-rank program."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is BOUNDARY:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.recompile()
    return gm
