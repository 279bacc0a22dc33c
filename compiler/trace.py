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

from compiler import trace_checks as checks
from compiler.decompose import decompositions, views_as_permutes
from compiler.distinct import split_shared_operands
from compiler.rewrites import Rewrites
from compiler.sources import SourceTracker, user_frame
from shardspec.errors import ShardingError, add_note, fail

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

    from compiler.passes.graph import quiet_fake_errors

    try:
        with quiet_fake_errors():  # an op failing on fake tensors is raised below, with the line
            module = _functional_graph(flat_fn, distinct, fn)
    except ShardingError:
        raise
    except Exception as exc:
        _raise_user_error(exc, fn)
        raise
    in_paths = tuple(leaf_paths[i] for i in positions)
    checks.reject_argument_mutation(module, in_paths, fn, args)
    checks.reject_random_ops(module)
    checks.reject_value_dependent_shapes(module)
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


def _functional_graph(
    flat_fn: Callable[..., Any], inputs: list[torch.Tensor], fn: Any = None
) -> torch.fx.GraphModule:
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
        checks.reject_constant_mutation(first, fn)
        checks.reject_sparse_constants(first)
        checks.lift_constants_written_with_inputs(first)
        checks.reject_scalar_extraction(first)
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
            "it as a Python scalar argument), index with a 1-element tensor instead of a 0-dim one "
            "(x.index_select(0, i.reshape(1)), torch.gather), or write the op from ops that do not "
            "read values.",
        ) from None
    if where != "<unknown line>":  # torch's own error (a shape mistake), raised on fake tensors
        add_note(exc, f"raised while tracing {name}, at {where}")
