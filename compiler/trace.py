"""Stage 1: trace a step into one functional core-ATen graph over tensors of *global* shape.

Arguments are flattened with optree; tensor leaves become graph inputs (fake tensors of the same shape
and dtype, so nothing is computed), Python scalars are baked in as constants. The function runs under
``make_fx(tracing_mode="fake")`` with the core-ATen decompositions so later stages see a small op set,
except fused kernels that have rules (layer norm's backward, GELU/softmax backward, CPU flash
attention), which stay one node; a graph with in-place ops is then replayed under ``functionalize`` so
they become out-of-place ops (a graph without them is functional already and is not traced twice).
User mistakes that tracing exposes become ShardingErrors naming the argument path and the user's line:
data-dependent Python control flow, in-place mutation of an argument, non-tensor leaves and results.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import optree
import torch
import torch.fx.traceback as fxt
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from compiler.decompose import decompositions, views_as_permutes
from compiler.distinct import split_shared_operands
from compiler.rewrites import RANDOM_OPS, Rewrites
from compiler.sources import SourceTracker, source_of, user_frame
from shardspec.errors import ShardingError, fail

_STATIC = (int, float, bool, str, type(None))
aten = torch.ops.aten


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one graph input or output (global, before sharding)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Traced:
    """A traced step: the graph plus how its flat inputs and outputs map to the user's pytrees."""

    module: torch.fx.GraphModule
    in_tree: optree.PyTreeSpec
    out_tree: optree.PyTreeSpec
    in_paths: tuple[str, ...]  # tensor inputs only, in graph placeholder order
    out_paths: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    tensor_positions: tuple[int, ...]  # which flat argument leaves are tensors


def path_str(root: str, path: Sequence[Any]) -> str:
    """``params['w1'][0]``-style name of a pytree leaf."""
    return root + "".join(f"[{k!r}]" for k in path)


_NAMES: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def arg_names(fn: Callable[..., Any], n: int) -> list[str]:
    """Names of the first ``n`` positional parameters of ``fn`` (``args[i]`` where unknown).

    Cached per function: every call of a sharded step names its arguments (``inspect.signature``
    costs tens of microseconds, once per tensor leaf)."""
    try:
        params = _NAMES.get(fn)
    except TypeError:
        params = None
    if params is None:
        try:
            params = tuple(
                p.name
                for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            )
        except (TypeError, ValueError):
            params = ()
        with contextlib.suppress(TypeError):
            _NAMES[fn] = params
    return [params[i] if i < len(params) else f"args[{i}]" for i in range(n)]


def trace(fn: Callable[..., Any], args: tuple[Any, ...]) -> Traced:
    """Trace ``fn(*args)`` into a functional core-ATen graph on global shapes."""
    names = arg_names(fn, len(args))
    paths, leaves, in_tree = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    leaf_paths = [path_str(names[p[0]], p[1:]) for p in paths]
    positions = []
    for i, (path, leaf) in enumerate(zip(leaf_paths, leaves, strict=True)):
        if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
            raise fail(
                f"{path}: a {leaf.layout} tensor of shape {tuple(leaf.shape)}; a sharded step takes "
                "dense (strided) tensors.",
                f"pass {path}.to_dense(), or keep the sparse computation outside the step.",
            )
        if isinstance(leaf, torch.Tensor):
            positions.append(i)
        elif not isinstance(leaf, _STATIC):
            raise fail(
                f"{path}: a leaf of type {type(leaf).__name__} is neither a tensor nor a Python "
                "scalar, so it cannot be traced.",
                "pass it as a torch.Tensor, or close over it instead of passing it as an argument.",
            )
    tensor_leaves = [leaves[i] for i in positions]
    out_info: dict[str, Any] = {}
    # one graph input per leaf: a tensor object passed twice (tied weights) would otherwise become
    # one input, and the program, cached by signature, would be wrong for later distinct leaves
    seen: set[int] = set()
    distinct = []
    for t in tensor_leaves:
        distinct.append(t.detach() if id(t) in seen else t)
        seen.add(id(t))

    def flat_fn(*tensors: torch.Tensor) -> list[torch.Tensor]:
        full = list(leaves)
        for i, t in zip(positions, tensors, strict=True):
            full[i] = t
        result = fn(*optree.tree_unflatten(in_tree, full))
        out_paths, out_leaves, out_tree = optree.tree_flatten_with_path(result, none_is_leaf=False)
        out_info["tree"] = out_tree
        out_info["paths"] = [path_str("result", p) for p in out_paths]
        for p, leaf in zip(out_info["paths"], out_leaves, strict=True):
            if not isinstance(leaf, torch.Tensor):
                raise fail(
                    f"{p}: the step returned a {type(leaf).__name__}, not a tensor.",
                    "return tensors only (e.g. torch.tensor(value) or a 0-dim result).",
                )
        return list(out_leaves)

    try:
        module = _functional_graph(flat_fn, distinct)
    except ShardingError:
        raise
    except Exception as exc:
        _raise_user_error(exc, fn)
        raise
    in_paths = tuple(leaf_paths[i] for i in positions)
    _reject_argument_mutation(module, in_paths, fn, args)
    _reject_random_ops(module)
    _reject_value_dependent_shapes(module)
    split_shared_operands(module.graph)
    outputs = tuple(
        TensorSpec(tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in _output_nodes(module)
    )
    return Traced(
        module,
        in_tree,
        out_info["tree"],
        in_paths,
        tuple(out_info["paths"]),
        tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensor_leaves),
        outputs,
        tuple(positions),
    )


@contextlib.contextmanager
def _tracing_flag() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true while the step is traced, as torch.export's
    non-strict (make_fx) tracing sets it: libraries take their traceable paths. Inside
    ``value_and_grad`` the tensors are functorch wrappers that transformers' own tracing checks
    (FakeTensor or fx.Proxy) do not recognise, so it read mask values and refused the step."""
    import torch.compiler as tc

    old = tc._is_compiling_flag
    tc._is_compiling_flag = True
    try:
        yield
    finally:
        tc._is_compiling_flag = old


def _functional_graph(flat_fn: Callable[..., Any], inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    """Trace with user source lines, then functionalize the traced graph.

    Two passes because autograd.Function (used by ``constrain``) cannot run under functionalize
    while autograd is being traced; the second pass replays the first graph through an
    fx.Interpreter, which carries every node's source line over to the nodes it becomes.
    """
    decomp = decompositions()

    def with_sources(*tensors: torch.Tensor) -> Any:
        with SourceTracker(), Rewrites(), _tracing_flag():
            return flat_fn(*tensors)

    # a lazy module: its Python code is generated only if the global graph is ever run or printed
    with fxt.preserve_node_meta(), _use_lazy_graph_module(True):
        # tensors the step closes over become constants of the graph (replicated on every rank)
        first = make_fx(
            with_sources, tracing_mode="fake", decomposition_table=decomp, _allow_non_fake_inputs=True
        )(*inputs)
        _reject_constant_mutation(first)
        _reject_sparse_constants(first)
        _lift_constants_written_with_inputs(first)
        _reject_scalar_extraction(first)
        if _already_functional(first):
            return first
        views_as_permutes(first.graph)
        replay = torch.fx.Interpreter(first).run
        return make_fx(
            torch.func.functionalize(replay, remove="mutations_and_views"),
            tracing_mode="fake",
            decomposition_table=decomp,
            _allow_non_fake_inputs=True,
        )(*inputs)


# view ops whose results the later stages handle as values (each has a rule in both its view and
# *_copy form); a graph with only these and no mutation is functional already
_PURE_VIEWS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "permute",
        "t",
        "transpose",
        "unsqueeze",
        "squeeze",
        "expand",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "unbind",
    }
)


def _already_functional(module: torch.fx.GraphModule) -> bool:
    """Whether the first trace needs no functionalization: no op mutates, every view is one the
    rules take as a value, and no result is (a view of) an argument or a constant, which
    functionalization would turn into a fresh tensor. Skipping the second trace halves tracing."""
    aliases: set[torch.fx.Node] = set()
    for n in module.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            aliases.add(n)
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is None:
            if n.target is operator.getitem and n.args[0] in aliases:
                aliases.add(n)
            continue
        if schema.is_mutable:
            return False
        if any(r.alias_info is not None for r in schema.returns):
            if n.target._opname not in _PURE_VIEWS or n.target is aten.view.dtype:
                return False
            if any(a in aliases for a in n.all_input_nodes):
                aliases.add(n)
    out = next(n for n in module.graph.nodes if n.op == "output")
    return not any(a in aliases for a in out.all_input_nodes)


def _reject_constant_mutation(module: torch.fx.GraphModule) -> None:
    """A tensor the step closes over is a graph constant; writing to it would be lost (or crash)."""
    for n in module.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        written = [n.args[0] if n.args else None, n.kwargs.get("out")]  # in place, or out=
        const = next((w for w in written if isinstance(w, torch.fx.Node) and w.op == "get_attr"), None)
        if n.op == "call_function" and schema is not None and schema.is_mutable and const is not None:
            raise fail(
                f"{n.target} at {source_of(n) or n.name} modifies in place a tensor the step closes over "
                f"(shape {tuple(const.meta['val'].shape)}). A sharded step is compiled once and must "
                "be functional: the write would not reach the outside tensor.",
                "pass that tensor in as an argument and return its new value, e.g. "
                "`buf = buf + x` ... `return ..., buf`.",
            )


def _reject_sparse_constants(module: torch.fx.GraphModule) -> None:
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


def _lift_constants_written_with_inputs(module: torch.fx.GraphModule) -> None:
    """``torch.zeros_like(T).add_(x)`` with ``T`` closed over: ops on constants alone run on plain
    tensors when the graph is replayed under functionalize, and an in-place write of a traced value
    into their result is a PyTorch internal assert. Each constant such a write descends from is
    read through ``lift_fresh_copy`` (what tracing does for ``torch.tensor(...)``), so the whole
    chain is functional; a write to the constant itself is refused above."""
    graph = module.graph
    plain: set[torch.fx.Node] = set()  # replayed on plain tensors: computed from constants alone
    for n in graph.nodes:
        ins = n.all_input_nodes
        if n.op == "get_attr" or (n.op == "call_function" and ins and all(a in plain for a in ins)):
            plain.add(n)
    lift: set[torch.fx.Node] = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None)
        target = n.args[0] if n.args else None
        if (
            n.op == "call_function"
            and schema is not None
            and schema.is_mutable
            and isinstance(target, torch.fx.Node)
            and target in plain
            and any(a not in plain for a in n.all_input_nodes)  # a functional value (even a factory's)
        ):
            todo = [target]
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


def _reject_scalar_extraction(module: torch.fx.GraphModule) -> None:
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


def _reject_value_dependent_shapes(module: torch.fx.GraphModule) -> None:
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


def _reject_random_ops(module: torch.fx.GraphModule) -> None:
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


def _output_nodes(module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    out = next(n for n in module.graph.nodes if n.op == "output")
    return list(out.args[0])


def _raise_user_error(exc: Exception, fn: Callable[..., Any]) -> None:
    text = f"{type(exc).__name__}: {exc}"
    name = getattr(fn, "__name__", "step")
    where = user_frame(exc.__traceback__)
    if "DynamicOutputShape" in text:
        raise fail(
            f"{name}: an op at {where} returns a shape that depends on tensor values ({exc}); the step "
            "is compiled once for fixed shapes.",
            "use a fixed-shape formulation (e.g. a mask with torch.where instead of nonzero/unique/"
            "boolean indexing), or run that op outside the step.",
        ) from None
    data_dependent = (
        "data-dependent" in text
        or "DataDependent" in text
        or "_local_scalar_dense" in text
        or "item()" in text
        or "data is not allocated" in text
        or ".numpy() is not supported" in text
        or ".tolist() is not supported" in text
    )
    if data_dependent:
        raise fail(
            f"{name}: a tensor's value is read as a Python value at {where} (a branch, a loop, a size, "
            ".item() or .tolist() on a tensor, or torch's own implementation of an op on that line, "
            "as torch.cov does). The step is traced once on shapes only, so what depends on a "
            "tensor's value cannot be compiled.",
            "compute both sides and select with torch.where, move the decision out of the step (pass "
            "it as a Python scalar argument), or write the op from ops that do not read values.",
        ) from None


class _FindMutation(TorchFunctionMode):
    """Eagerly finds the first in-place op on an argument, to name the user's line."""

    def __init__(self, targets: dict[int, str]) -> None:
        super().__init__()
        self.targets = targets
        self.found: tuple[str, str] | None = None
        self.keep: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        written = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if written is not None and id(written) not in self.targets and written._is_view():
            written = written._base  # a write through a view (x[0].add_(1)) writes the argument
        if (
            self.found is None
            and written is not None
            and id(written) in self.targets
            and (
                (name.endswith("_") and not name.endswith("__"))
                or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
            )
        ):
            self.found = (self.targets[id(written)], user_frame(None))
        out = func(*args, **(kwargs or {}))
        if name in ("detach", "alias") and written is not None and id(written) in self.targets:
            self.targets[id(out)] = self.targets[id(written)]  # the same storage, not a view
            self.keep.append(out)  # (its id stays its own while the step runs)
        return out


def _reject_argument_mutation(
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
    line = _mutation_line(fn, args)
    raise fail(
        f"{mutated[0]} is modified in place{f' at {line}' if line else ''}. A traced step must "
        "be functional: arguments are read, new values are returned.",
        "compute a new tensor (e.g. `w = w + 1` instead of `w.add_(1)`) and return it; "
        "the caller rebinds it.",
    )


def _mutation_line(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    paths, leaves, tree = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    names = arg_names(fn, len(args))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        targets = {
            id(f): path_str(names[p[0]], p[1:])
            for p, f in zip(paths, fakes, strict=True)
            if isinstance(f, torch.Tensor)
        }
        finder = _FindMutation(targets)
        try:
            with finder:
                fn(*optree.tree_unflatten(tree, fakes))
        except Exception:
            pass
    return finder.found[1] if finder.found else None
