"""Checks of a traced step's graph that turn what tracing exposes into ShardingErrors naming the
argument and the user's line: mutation of an argument or of a closed-over constant, sparse
constants, values read as Python values, value-dependent shapes, random ops outside
``shardspec.random``; and the one rewrite a constant written together with an input needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import optree
import torch
from torch.overrides import TorchFunctionMode

from compiler.rewrites import RANDOM_OPS
from compiler.sources import source_of, user_frame
from shardspec.errors import fail

aten = torch.ops.aten


def reject_constant_mutation(module: torch.fx.GraphModule, fn: Any = None) -> None:
    """A tensor the step closes over is a graph constant; writing to it would be lost (or crash)."""
    for n in module.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        const = next((b for w in _writes(n, schema) if (b := _view_base(w)).op == "get_attr"), None)
        if const is not None:
            held = _held_at(fn, getattr(module, str(const.target), None))
            buffer = any(isinstance(p.parent().resolve(), torch.nn.Module) for p in held)
            raise fail(
                f"{n.target} at {source_of(n) or n.name} modifies in place a tensor the step closes over "
                f"({', '.join(map(str, held[:3])) + ', ' if held else ''}shape "
                f"{tuple(const.meta['val'].shape)}). A sharded step is compiled once and must be "
                "functional: the write would not reach the outside tensor.",
                "pass that tensor in as an argument and return its new value, e.g. "
                "`buf = buf + x` ... `return ..., buf`"
                + (
                    "; for a module's buffers (batch norm's running statistics), pass them with "
                    "torch.func.functional_call(model, (params, buffers), ...) and return the "
                    "updated copies, or call model.eval()."
                    if buffer
                    else "."
                ),
            )


def _view_base(n: torch.fx.Node) -> torch.fx.Node:
    """The value ``n`` is a view of (``W[0]``, ``W.t()``, ``W.detach()`` -> ``W``), else ``n``:
    a write through a view writes its base."""
    while n.op == "call_function" and n.args and isinstance(n.args[0], torch.fx.Node):
        schema = getattr(n.target, "_schema", None)
        returns = schema.returns if schema is not None else ()
        if not returns or returns[0].alias_info is None or returns[0].alias_info.is_write:
            break
        n = n.args[0]
    return n


def _writes(n: torch.fx.Node, schema: Any) -> list[torch.fx.Node]:
    """The operands an op writes, by its schema: ``self`` of an in-place op, ``out=`` (or each of
    a multi-output op's named outs, ``values=``/``indices=``)."""
    found = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
        found += [x for x in (v if isinstance(v, (tuple, list)) else [v]) if isinstance(x, torch.fx.Node)]
    return found


def _held_at(fn: Any, tensor: Any) -> list[Any]:
    """The places the step reads ``tensor`` from (``model.bn.running_mean``), to name it in an error;
    none when they cannot be found."""
    if fn is None or not isinstance(tensor, torch.Tensor):
        return []
    from compiler.reach import Code, places

    try:
        return [p for p, _ in places({id(tensor): tensor}, Code(fn, getattr(fn, "__self__", None)))]
    except Exception:  # naming is best effort: the error below stands without it
        return []


def reject_sparse_constants(module: torch.fx.GraphModule) -> None:
    """A sparse tensor the step closes over has no dense layout to split (arguments are checked
    the same way in ``trace``)."""
    for n in module.graph.nodes:
        value = getattr(module, str(n.target), None) if n.op == "get_attr" else None
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            used = next(iter(n.users), None)
            raise fail(
                f"the step closes over a {value.layout} tensor of shape {tuple(value.shape)} (used at "
                f"{(source_of(used) if used is not None else None) or n.name}); a sharded step takes "
                "dense (strided) tensors.",
                "close over its .to_dense(), or keep the sparse computation outside the step.",
            )


def lift_constants_written_with_inputs(module: torch.fx.GraphModule) -> None:
    """``torch.zeros_like(T).add_(x)`` or ``b = T.clone(); b[0] = 0`` with ``T`` closed over: ops on
    constants alone run on plain tensors when the graph is replayed under functionalize, and an
    in-place write into their result is a PyTorch internal assert. Each constant such a write
    descends from is read through ``lift_fresh_copy`` (what tracing does for ``torch.tensor(...)``),
    so the whole chain is functional; a write to the constant itself is refused above."""
    graph = module.graph
    plain: set[torch.fx.Node] = set()  # replayed on plain tensors: computed from constants alone
    for n in graph.nodes:
        ins = n.all_input_nodes
        if n.op == "get_attr" or (n.op == "call_function" and ins and all(a in plain for a in ins)):
            plain.add(n)
    lift: set[torch.fx.Node] = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        todo = [w for w in _writes(n, schema) if w in plain]  # (a copy of a constant: b = W.clone())
        while todo:
            x = todo.pop()
            if x.op == "get_attr":
                lift.add(x)
            todo += x.all_input_nodes
    for const in lift:
        with graph.inserting_after(const):
            lifted = graph.call_function(aten.lift_fresh_copy.default, (const,))
        lifted.meta.update(const.meta)
        for user in [u for u in const.users if u is not lifted]:
            user.replace_input_with(const, lifted)
    if lift:
        module.recompile()


def reject_scalar_extraction(module: torch.fx.GraphModule) -> None:
    """``.item()`` / ``float(t)`` turn a tensor value into a Python number the plan cannot shard."""
    for n in module.graph.nodes:
        val = n.meta.get("val")
        if n.target is aten._local_scalar_dense.default or isinstance(
            val, (torch.SymInt, torch.SymFloat, torch.SymBool)
        ):
            raise fail(
                f"the step reads a tensor's value as a Python number (.item(), float(t), int(t) or "
                f".tolist()) at {source_of(n) or n.name}; a sharded step is traced once on shapes "
                "only, so the number is not known when it is compiled.",
                "keep it a tensor (use the 0-dim tensor directly in arithmetic: `x * t.sum()` instead "
                "of `x * t.sum().item()`), or compute it outside the step and pass it in as an argument.",
            )


def reject_value_dependent_shapes(module: torch.fx.GraphModule) -> None:
    for n in module.graph.nodes:
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (tuple, list)) else [vals]:
            if isinstance(v, torch.Tensor) and any(not isinstance(d, int) for d in v.shape):
                raise fail(
                    f"{n.target} at {source_of(n) or n.name} returns a shape that depends on tensor "
                    f"values ({tuple(v.shape)}); the step is compiled once for fixed shapes.",
                    "use a fixed-shape formulation (a mask with torch.where instead of nonzero, "
                    "unique or boolean indexing), or run that op outside the step.",
                )


def reject_random_ops(module: torch.fx.GraphModule) -> None:
    for n in module.graph.nodes:
        if n.op == "call_function" and (
            str(n.target).rsplit(".", 1)[0] in RANDOM_OPS
            or (  # rrelu, poisson, cauchy_, ...: attention kernels carry the tag for a dropout
                # they are never given here (SDPA's dropout_p is refused when it is traced)
                torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                and "scaled_dot_product" not in str(n.target)
            )
        ):
            op = n.meta.get("original_aten") or n.target  # bernoulli, not the rand it becomes
            raise fail(
                f"{op} at {source_of(n) or n.name}: random numbers inside a sharded step "
                "would differ with the layout (each device would draw its own).",
                (
                    "write torch.bernoulli(probs) as (torch.rand_like(probs) < probs).to(probs.dtype) and "
                    "torch.bernoulli(x, p) as (torch.rand_like(x) < p).to(x.dtype); in general, "
                    if "bernoulli" in str(op)
                    else ""
                )
                + "use dropout, torch.rand/randn or rand_like/randn_like without a generator (drawn "
                "counter-based inside a step, the same on every mesh: shardspec.random), or draw the "
                "tensor outside the step and pass it in as an argument.",
            )


class _FindMutation(TorchFunctionMode):
    """Eagerly finds the first in-place op on an argument, to name the user's line."""

    def __init__(self, targets: dict[int, str]) -> None:
        super().__init__()
        self.targets = targets
        self.found: tuple[str, str, str] | None = None  # argument path, user's line, op
        self.keep: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.found is None:
            for w in _written(func, name, args, kwargs or {}):
                # a write through a view (x[0].add_(1)) writes the argument
                t = w._base if id(w) not in self.targets and w._is_view() else w
                if t is not None and id(t) in self.targets:
                    self.found = (self.targets[id(t)], user_frame(None), name)
                    break
        out = func(*args, **(kwargs or {}))
        if name in ("detach", "alias") and first is not None and id(first) in self.targets:
            self.targets[id(out)] = self.targets[id(first)]  # the same storage, not a view
            self.keep.append(out)  # (its id stays its own while the step runs)
        return out


_BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")
_IN_PLACE_DUNDERS = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})  # flags, not values
# the norms that write their running statistics in training: (training flag, its position, the
# statistics' positions and names)
_STATS = ((1, "running_mean"), (2, "running_var"))
_NORMS: dict[Any, tuple[str, int, tuple[tuple[int, str], ...]]] = {
    torch.nn.functional.batch_norm: ("training", 5, _STATS),
    torch.nn.functional.instance_norm: ("use_input_stats", 5, _STATS),
    torch.batch_norm: ("training", 5, ((3, "running_mean"), (4, "running_var"))),
}


def _written(func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a torch function call writes: an in-place op's first argument, ``out=``, and
    batch norm's running statistics in training (written although they are inputs)."""
    found: list[Any] = []
    if args and (
        (name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES)
        or name in _IN_PLACE_DUNDERS
    ):
        found.append(args[0])
    out = kwargs.get("out")
    found += list(out) if isinstance(out, (tuple, list)) else [out]
    norm = _NORMS.get(func)
    if norm is not None:
        flag, at, stats = norm
        on = args[at] if len(args) > at else kwargs.get(flag, func is torch.nn.functional.instance_norm)
        if on:
            found += [args[i] if len(args) > i else kwargs.get(k) for i, k in stats]
    return [t for t in found if isinstance(t, torch.Tensor)]


def reject_argument_mutation(
    module: torch.fx.GraphModule, in_paths: tuple[str, ...], fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    mutated = [
        in_paths[placeholders.index(n.args[0])]
        for n in module.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders
    ]
    if not mutated:
        return
    line, op = _mutation_line(fn, args, mutated[0])
    norm = op in ("batch_norm", "instance_norm") or any(s in mutated[0] for s in _BUFFER_NAMES)
    raise fail(
        f"{mutated[0]} is modified in place{f' at {line}' if line else ''}"
        f"{' (a norm updates its running statistics in place)' if norm else ''}. A traced step must "
        "be functional: arguments are read, new values are returned.",
        (
            "pass copies to the norm and return them: `rm, rv = rm.clone(), rv.clone()` before "
            "the call (a module's buffers through functional_call: `buffers = {k: v.clone() for "
            "k, v in buffers.items()}`), then return the copies."
            if norm
            else "compute a new tensor (e.g. `w = w + 1` instead of `w.add_(1)`) and return it; "
            "the caller rebinds it."
        ),
    )


def _mutation_line(fn: Callable[..., Any], args: tuple[Any, ...], path: str) -> tuple[str | None, str | None]:
    """The user's line (and the op) of the first write to the argument at ``path``, found by
    running the step eagerly on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compiler.trace import arg_names, path_str  # trace imports this module

    paths, leaves, tree = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    names = arg_names(fn, len(args))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        targets = {
            id(f): path_str(names[p[0]], p[1:])
            for p, f in zip(paths, fakes, strict=True)
            if isinstance(f, torch.Tensor) and path_str(names[p[0]], p[1:]) == path
        }
        finder = _FindMutation(targets)
        try:
            with finder:
                fn(*optree.tree_unflatten(tree, fakes))
        except Exception:
            pass
    return (finder.found[1], finder.found[2]) if finder.found else (None, None)
