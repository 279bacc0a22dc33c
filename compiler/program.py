"""Stages 1-4 glued: match specs to arguments, trace, propagate, partition; one ``Program`` per
argument signature."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import optree
import torch
from torch.fx import GraphModule

from compiler.partition import Inserted, partition
from compiler.propagate import Propagation, propagate
from compiler.sharding import Sharding
from compiler.trace import Traced, arg_names, path_str, trace
from shardspec.errors import fail
from shardspec.layout import check_spec, is_even
from shardspec.mesh import Mesh
from shardspec.placements import spec_to_placements
from shardspec.spec import P


@dataclass(frozen=True)
class Program:
    traced: Traced
    prop: Propagation
    mesh: Mesh
    in_specs: tuple[P, ...]  # per tensor input, in graph order
    out_specs: tuple[P, ...]
    programs: tuple[GraphModule, ...]  # per rank (the same object for every rank when even)
    inserted: tuple[Inserted, ...]  # rank 0's


def broadcast_specs(specs: Any, tree: Any, what: str, names: list[str] | None = None) -> list[P]:
    """One P per leaf of ``tree``; ``specs`` may be a prefix (one P covering a subtree)."""
    try:
        return list(optree.broadcast_prefix(specs, tree, none_is_leaf=False))
    except ValueError as exc:
        spec_struct = optree.tree_structure(specs, none_is_leaf=False)
        arg_struct = optree.tree_structure(tree, none_is_leaf=False)
        raise fail(
            f"{what} does not match the structure of the {'arguments' if names else 'results'}"
            f": specs {spec_struct} vs values {arg_struct} ({exc}).",
            f"give {what} the same tree as the values, or a prefix of it (one P covers a whole subtree).",
        ) from None


def compile_program(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    unsupported: str,
    strict: bool = False,
) -> Program:
    names = arg_names(fn, len(args))
    if not isinstance(in_specs, tuple) or len(in_specs) != len(args):
        n = len(in_specs) if isinstance(in_specs, tuple) else "a non-tuple"
        raise fail(
            f"in_specs has {n} entries but the step was called with {len(args)} arguments "
            f"({', '.join(names)}).",
            "pass in_specs as a tuple with one spec tree per positional argument.",
        )
    leaf_specs = broadcast_specs(in_specs, args, "in_specs", names)
    paths, leaves, _ = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    tensor_specs = []
    for path, leaf, spec in zip(paths, leaves, leaf_specs, strict=True):
        where = path_str(names[path[0]], path[1:])
        if not isinstance(spec, P):
            raise fail(f"in_specs for {where} is {spec!r}, not a P.", "use P(...) (P() = replicated).")
        if isinstance(leaf, torch.Tensor):
            check_spec(tuple(leaf.shape), mesh, spec, name=where)
            tensor_specs.append(spec)
        elif spec != P():
            raise fail(
                f"{where} is a Python {type(leaf).__name__} ({leaf!r}) but its spec is {spec}; "
                "only tensors can be split.",
                f"use P() for {where}, or pass it as a tensor.",
            )
    traced = trace(fn, args)
    out_leaf_specs = broadcast_specs(
        out_specs, optree.tree_unflatten(traced.out_tree, list(range(len(traced.outputs)))), "out_specs"
    )
    for out_path, spec, info in zip(traced.out_paths, out_leaf_specs, traced.outputs, strict=True):
        if not isinstance(spec, P):
            raise fail(f"out_specs for {out_path} is {spec!r}, not a P.", "use P(...) (P() = replicated).")
        check_spec(info.shape, mesh, spec, name=out_path)
    if not mesh.simulated:  # real results are DTensors: every layout must be one DTensor can hold
        for p, s, t in zip(traced.in_paths, tensor_specs, traced.inputs, strict=True):
            spec_to_placements(s, mesh, t.shape, name=p)
        for p, s, t in zip(traced.out_paths, out_leaf_specs, traced.outputs, strict=True):
            spec_to_placements(s, mesh, t.shape, name=p)
    inputs = [Sharding.of(s, len(t.shape)) for s, t in zip(tensor_specs, traced.inputs, strict=True)]
    outputs = [Sharding.of(s, len(t.shape)) for s, t in zip(out_leaf_specs, traced.outputs, strict=True)]
    prop = propagate(traced.module.graph, inputs, outputs, mesh, unsupported, strict=strict)
    first, inserted = partition(traced.module, prop, mesh, 0, list(traced.in_paths))
    programs = [first]
    if not _even(prop, mesh):
        programs += [
            partition(traced.module, prop, mesh, r, list(traced.in_paths))[0] for r in range(1, mesh.size)
        ]
    else:
        programs *= mesh.size
    return Program(
        traced, prop, mesh, tuple(tensor_specs), tuple(out_leaf_specs), tuple(programs), tuple(inserted)
    )


def _even(prop: Propagation, mesh: Mesh) -> bool:
    for node, s in prop.value.items():
        vals = s if isinstance(s, tuple) else (s,)
        metas = (
            node.meta["val"] if isinstance(node.meta.get("val"), (tuple, list)) else [node.meta.get("val")]
        )
        for sh, meta in zip(vals, metas, strict=False):
            if (
                isinstance(sh, Sharding)
                and meta is not None
                and sh.dims
                and not is_even(tuple(meta.shape), mesh, sh.spec)
            ):
                return False
    return True
