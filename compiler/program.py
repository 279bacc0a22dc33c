"""Stages 1-4 glued: match specs to arguments, trace, propagate, partition; one ``Program`` per
argument signature."""

from __future__ import annotations

import functools
import gc
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import optree
import torch
from torch.fx import GraphModule, Node

from compiler import passes as program_passes
from compiler.checkpointing import regions
from compiler.partition import Inserted, partition
from compiler.pipeline.plan import (
    PipelinePlan,
    check_pipeline,
    check_pipeline_layouts,
    drop_boundaries,
    plan_pipeline,
)
from compiler.plan.auto import AUTO
from compiler.propagate import Propagation, propagate
from compiler.sharding import Sharding
from compiler.sources import source_of
from compiler.trace import Traced, arg_names, path_str, trace
from shardspec.errors import fail, shown
from shardspec.layout import check_spec, local_shape
from shardspec.mesh import Mesh
from shardspec.pipeline import Pipeline
from shardspec.placements import spec_to_placements
from shardspec.spec import P
from shardspec.spec_tree import keyed_like, mismatch


@dataclass(frozen=True)
class Program:
    traced: Traced
    prop: Propagation
    mesh: Mesh
    in_specs: tuple[P, ...]  # per tensor input, in graph order
    out_specs: tuple[P, ...]
    programs: tuple[GraphModule, ...]  # per rank (the same object for every rank when even)
    inserted: tuple[Inserted, ...]  # rank 0's
    donated: tuple[int, ...] = ()  # tensor inputs whose buffers the results may take (donate=)
    pipeline: PipelinePlan | None = None  # sharded(pipeline=...): stages, schedule, stage programs
    cost_model: Any = None  # sharded(cost_model=...): the machine the global planner priced
    eager_calls: tuple[bool, bool] = (False, False)  # the eager real runtime's fast_calls, fast_gelu


def per_argument(
    in_specs: Any, args: tuple[Any, ...], names: list[str], step: str = "the step"
) -> tuple[Any, ...]:
    """``in_specs`` as one spec tree per positional argument (a list means the same as a tuple)."""
    if isinstance(in_specs, list) and len(in_specs) == len(args):
        in_specs = tuple(in_specs)
    if not isinstance(in_specs, tuple) or len(in_specs) != len(args):
        got = (
            f"has {len(in_specs)} entries"
            if isinstance(in_specs, (tuple, list))
            else f"is a {type(in_specs).__name__}"
        )
        raise fail(
            f"in_specs {got} but {step} was called with {len(args)} arguments ({', '.join(names)}).",
            "pass in_specs as a tuple with one spec tree per positional argument, e.g. "
            f"in_specs=({', '.join('P()' for _ in names)},).",
        )
    return in_specs


def broadcast_specs(specs: Any, tree: Any, what: str, names: list[str] | None = None) -> list[P]:
    """One P per leaf of ``tree``; ``specs`` may be a prefix (one P covering a subtree)."""
    try:
        return list(optree.broadcast_prefix(keyed_like(specs, tree), tree, none_is_leaf=False))
    except ValueError as exc:
        if names and isinstance(specs, tuple) and len(specs) == len(tree):
            found = next((m for s, v, n in zip(specs, tree, names) if (m := mismatch(s, v, n))), None)
        else:
            found = mismatch(specs, tree, "result")
        where, detail = found or ("the top level", _without_values(str(exc)))
        raise fail(
            f"{what} does not match the structure of the {'arguments' if names else 'results'} at "
            f"{where}: {detail}.",
            f"give {what} the same tree as the values, or a prefix of it (one P covers a whole subtree).",
        ) from None


def _without_values(text: str) -> str:
    """optree's message minus the dump of the values (megabytes of numbers for a real model)."""
    cut = re.search(r"; \w+: [\[{(]", text)
    return (text[: cut.start()] if cut else text)[:400]


def _cyclic_gc_deferred(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with Python's cyclic garbage collector paused, then collect once what it made.

    Compiling allocates hundreds of thousands of long-lived objects (graph nodes, fake tensors),
    which trigger full collections that rescan the whole heap: a third of a 24-layer GPT's
    compile. Paused, every object the compile made stays in the youngest generation, so one
    young collection at the end frees its cycles at the cost of a single scan of them."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
            gc.collect(0)

    return run


@_cyclic_gc_deferred
def compile_program(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    unsupported: str,
    strict: bool = False,
    passes: Any = None,
    donate: tuple[int, ...] = (),
    pipeline: Pipeline | None = None,
    cost_model: Any = None,
    held_buckets: bool = False,
) -> Program:
    names = arg_names(fn, len(args))
    in_specs = per_argument(in_specs, args, names)
    leaf_specs = broadcast_specs(in_specs, args, "in_specs", names)
    paths, leaves, _ = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    tensor_specs: list[P] = []
    donated: list[int] = []
    auto_in: list[int] = []  # tensor inputs whose layout the planner chooses (AUTO)
    for path, leaf, spec in zip(paths, leaves, leaf_specs, strict=True):
        where = path_str(names[path[0]], path[1:])
        if cast(Any, spec) is AUTO:  # replicated for the greedy warm start; the planner chooses
            spec = P()
            if isinstance(leaf, torch.Tensor):
                auto_in.append(len(tensor_specs))
        if not isinstance(spec, P):
            raise fail(f"in_specs for {where} is {shown(spec)}, not a P.", "use P(...) (P() = replicated).")
        if isinstance(leaf, torch.Tensor):
            check_spec(tuple(leaf.shape), mesh, spec, name=where)
            if path[0] in donate:
                donated.append(len(tensor_specs))
            tensor_specs.append(spec)
        elif spec != P():
            raise fail(
                f"{where} is a Python {type(leaf).__name__} ({leaf!r}) but its spec is {spec}; "
                "only tensors can be split.",
                f"use P() for {where}, or pass it as a tensor.",
            )
    traced = trace(fn, args)
    if pipeline is not None:
        check_pipeline(pipeline, mesh, list(zip(traced.in_paths, tensor_specs, strict=True)))
    out_leaf_specs = broadcast_specs(
        out_specs, optree.tree_unflatten(traced.out_tree, list(traced.outputs)), "out_specs"
    )
    auto_out = [k for k, s in enumerate(cast(list[Any], out_leaf_specs)) if s is AUTO]
    out_leaf_specs = [P() if k in auto_out else s for k, s in enumerate(out_leaf_specs)]
    for out_path, spec, info in zip(traced.out_paths, out_leaf_specs, traced.outputs, strict=True):
        if not isinstance(spec, P):
            raise fail(
                f"out_specs for {out_path} is {shown(spec)}, not a P.", "use P(...) (P() = replicated)."
            )
        check_spec(info.shape, mesh, spec, name=out_path)
    if pipeline is not None:
        check_pipeline(pipeline, mesh, list(zip(traced.out_paths, out_leaf_specs, strict=True)))
    if not mesh.simulated:  # real results are DTensors: every layout must be one DTensor can hold
        for p, s, t in zip(traced.in_paths, tensor_specs, traced.inputs, strict=True):
            spec_to_placements(s, mesh, t.shape, name=p)
        for p, s, t in zip(traced.out_paths, out_leaf_specs, traced.outputs, strict=True):
            spec_to_placements(s, mesh, t.shape, name=p)
    # axes of size 1 split nothing: dropped, so layouts naming them meet the others' rules for free
    inputs = [Sharding.of(s, len(t.shape), mesh) for s, t in zip(tensor_specs, traced.inputs, strict=True)]
    outputs = [
        Sharding.of(s, len(t.shape), mesh) for s, t in zip(out_leaf_specs, traced.outputs, strict=True)
    ]
    prop = propagate(traced.module.graph, inputs, outputs, mesh, unsupported, strict=strict)
    if cost_model is not None or auto_in or auto_out:  # the global planner, never worse than greedy
        from compiler.plan import CostModel, Free, plan_globally

        regather = program_passes.options(passes).regather
        fixed = frozenset({pipeline.axis} if pipeline is not None else ())
        free = Free(auto_in, auto_out, {i: traced.in_paths[i] for i in auto_in}, fixed)
        model = cost_model if cost_model is not None else CostModel()
        prop = plan_globally(
            traced.module.graph, prop, inputs, outputs, mesh, model, unsupported, regather=regather, free=free
        )
        holders = [n for n in traced.module.graph.nodes if n.op == "placeholder"]
        for i in auto_in:  # the layouts the planner chose for AUTO leaves
            tensor_specs[i] = prop.value[holders[i]].spec
        for k in auto_out:
            out_leaf_specs[k] = prop.outputs[k].spec
    if pipeline is not None:
        check_pipeline_layouts(pipeline, traced.module.graph, prop.value)
    first, inserted = partition(traced.module, prop, mesh, 0, list(traced.in_paths))
    programs = [first]
    even = _even(prop, mesh, traced.module.graph)
    if not even:
        programs += [
            partition(traced.module, prop, mesh, r, list(traced.in_paths))[0] for r in range(1, mesh.size)
        ]
    else:
        programs *= mesh.size

    def local(r: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [
            (local_shape(t.shape, mesh, s, r), t.dtype)
            for t, s in zip(traced.inputs, tensor_specs, strict=True)
        ]

    # even: every rank's blocks have rank 0's shapes, so one list serves all (not mesh-size work)
    local_inputs = [local(0)] * mesh.size if even else [local(r) for r in range(mesh.size)]
    backward = frozenset(
        n.name for n in traced.module.graph.nodes if source_of(n).startswith("backward of ")
    )  # regather tells forward from backward uses by these
    remat = regions(traced.module)  # ops inside shardspec.remat, recomputed for backward
    opts = program_passes.options(passes)
    if pipeline is not None:
        plan = plan_pipeline(pipeline, mesh, traced.module, programs, local_inputs, passes, backward, remat)
        return Program(
            traced,
            prop,
            mesh,
            tuple(tensor_specs),
            tuple(out_leaf_specs),
            tuple(s.module for s in plan.per_rank),
            tuple(inserted),
            (),
            plan,
            eager_calls=program_passes.eager_calls(opts),
        )
    for gm in dict.fromkeys(programs):  # without a pipeline a boundary is an identity
        drop_boundaries(gm)
    if opts.memory_budget is not None and not even:
        raise fail(
            f"sharded(memory_budget={opts.memory_budget:,}) needs every rank to hold blocks of one "
            f"shape, but {_uneven_value(traced, tensor_specs, mesh)} is split unevenly, so ranks run "
            "different programs.",
            "make the split dimensions divisible by their axes' sizes (pad them), or drop "
            "memory_budget (the default schedule gathers every parameter backward reads again: the "
            "lowest peak).",
        )
    programs = list(
        program_passes.schedule_programs(
            programs, local_inputs, opts, backward, remat, traced, donated, held_buckets
        )
    )
    return Program(
        traced,
        prop,
        mesh,
        tuple(tensor_specs),
        tuple(out_leaf_specs),
        tuple(programs),
        tuple(inserted),
        tuple(donated),
        cost_model=cost_model,
        eager_calls=program_passes.eager_calls(opts),
    )


def _uneven_value(traced: Any, specs: list[P], mesh: Mesh) -> str:
    """The first argument a spec splits unevenly, named with its shape and spec (else: a value
    inside the step, which a ``constrain`` splits so)."""
    for path, info, spec in zip(traced.in_paths, traced.inputs, specs, strict=True):
        for dim, size in enumerate(info.shape):
            axes = spec.axes_of(dim)
            if axes and size % mesh.axis_size(axes):
                return (
                    f"{path} (shape {tuple(info.shape)}, spec {spec}: dim {dim} of size {size} over "
                    f"{mesh.axis_size(axes)} devices)"
                )
    return "a value inside the step (a constrain's layout)"


def _even(prop: Propagation, mesh: Mesh, graph: Any = None) -> bool:
    """Whether every rank's program has the same shapes: every value, every layout an op asks of
    an operand and every result's layout splits its dims evenly. A program shared by all ranks is
    shape-propagated with rank 0's blocks, so bucketing and donation would size buffers by them."""
    wanted: list[tuple[Any, Any]] = []
    for p in prop.plans.values():
        wanted += [(o.meta.get("val"), r) for o, r in zip(p.operands, p.required, strict=False)]
    if graph is not None:
        out = next(n for n in graph.nodes if n.op == "output")
        wanted += [
            (v.meta.get("val") if isinstance(v, Node) else None, s)
            for v, s in zip(out.args[0], prop.outputs, strict=False)
        ]
    for meta, sh in wanted:
        if (
            isinstance(sh, Sharding)
            and isinstance(meta, torch.Tensor)
            and not _splits_evenly(meta.shape, sh, mesh)
        ):
            return False
    for node, s in prop.value.items():
        vals = s if isinstance(s, tuple) else (s,)
        metas = (
            node.meta["val"] if isinstance(node.meta.get("val"), (tuple, list)) else [node.meta.get("val")]
        )
        for sh, meta in zip(vals, metas, strict=False):
            if (
                isinstance(sh, Sharding)
                and isinstance(meta, torch.Tensor)
                and not _splits_evenly(meta.shape, sh, mesh)
            ):
                return False
    return True


def _splits_evenly(shape: Any, sh: Sharding, mesh: Mesh) -> bool:
    """``is_even`` on the layout's axes directly (no ``P`` built per value: tens of thousands)."""
    return all(not axes or shape[d] % mesh.axis_size(axes) == 0 for d, axes in enumerate(sh.dims))
