"""Shared helpers of the program passes: copying a program, fake values, aliasing, collective nodes.

Every pass works on a copy, so a pass is a pure function of its input program. Passes read shapes and
dtypes from ``meta["val"]`` (fake tensors), propagated once by ``annotate`` and set on every node a
pass creates by ``make``, so no pass re-runs the whole program under fake tensors.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

aten = torch.ops.aten
shardspec = torch.ops.shardspec
# collectives a program launches (local_slice and matmul are shardspec ops that communicate nothing)
LAUNCHES = {
    shardspec.all_gather.default,
    shardspec.reduce_scatter.default,
    shardspec.all_reduce.default,
    shardspec.all_reduce_inplace.default,
    shardspec.all_to_all.default,
    shardspec.ppermute.default,
    shardspec.broadcast.default,
}
# ops that return a tensor sharing storage with an input although their schema does not say so
_HIDDEN_ALIASES = {aten._unsafe_view.default}


class LazyProgram(_LazyGraphModule):
    """A program whose Python code is generated when it first runs or prints, not each time a
    stage or pass rewrites it (about 0.2 s per generation on a 24-layer GPT step). Simulated ranks
    run one shared program from several threads: the first run generates the code under a lock
    (code generation rewrites the nodes' printers, so two at once would emit a broken program)."""

    _generating = threading.Lock()

    def _lazy_forward(self, *args: Any, **kwargs: Any) -> Any:
        with LazyProgram._generating:
            self.real_recompile()
        return self(*args, **kwargs)

    forward = _lazy_forward


def copy_module(gm: GraphModule) -> GraphModule:
    """A new program with the same nodes (meta included) and the same constants."""
    graph = Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return LazyProgram(gm, graph)


def annotate(gm: GraphModule, inputs: Sequence[tuple[Sequence[int], torch.dtype]]) -> None:
    """Set ``meta["val"]`` on every node from the program's input shapes and dtypes.

    Each op runs its meta kernel on meta tensors (shapes, strides and storage sharing, no data),
    without the fake-tensor dispatch layer: about half the time of fake-tensor propagation on a deep
    program. Each result is wrapped as a fake tensor of one mode, so a pass can compute a new node's
    value under it (``make``). An op that fails on meta tensors (no meta kernel) falls back to fake
    propagation of the whole program, which raises where shapes really do not propagate."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        _meta_propagate(gm, inputs, mode)
    except Exception:
        fakes = [mode.from_tensor(torch.empty(tuple(s), dtype=d)) for s, d in inputs]
        with quiet_fake_errors():  # a failure here is the caller's to handle, not a log's
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)


@contextlib.contextmanager
def quiet_fake_errors() -> Iterator[None]:
    """Fake-tensor propagation logs every op that fails on its meta kernel at ERROR level, with a
    traceback, before raising. Where a failure is expected and handled (shapes that do not propagate
    on a rank whose uneven block is shorter), that log is a screenful of noise on a correct run."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


_META, _CPU = torch.device("meta"), torch.device("cpu")


def _meta_propagate(gm: GraphModule, inputs: Sequence[tuple[Sequence[int], torch.dtype]], mode: Any) -> None:
    env: dict[Node, Any] = {}
    seen: dict[Any, Any] = {}  # an op's result layout by its inputs' (repeated layers repeat them)
    holders = iter(inputs)

    def arg(a: Any) -> Any:
        if isinstance(a, Node):
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return _META if isinstance(a, torch.device) else a  # factories build meta tensors too

    def fake(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return FakeTensor(mode, v, _CPU)
        if isinstance(v, (list, tuple)):
            return type(v)(fake(x) for x in v)
        return v if isinstance(v, (int, float, bool)) else None

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            shape, dtype = next(holders)
            env[n] = torch.empty(tuple(shape), dtype=dtype, device=_META)
        elif n.op == "get_attr":
            t = getattr(gm, n.target)
            env[n] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
        elif n.op == "call_function":
            args, kwargs = arg(n.args), arg(n.kwargs)
            key = _meta_key(n.target, args, kwargs)
            if key is None:
                env[n] = n.target(*args, **kwargs)
            elif key in seen:
                env[n] = _rebuild(seen[key])
            else:
                env[n] = n.target(*args, **kwargs)
                with contextlib.suppress(TypeError):
                    seen[key] = _layout(env[n])
        elif n.op == "output":
            env[n] = arg(n.args[0])
        else:
            raise NotImplementedError(n.op)  # a module or method call: fake propagation handles it
        value = fake(env[n])
        if value is not None:
            n.meta["val"] = value


def _meta_key(target: Any, args: Any, kwargs: Any) -> Any:
    """What a fresh-result op's meta kernel reads (the op, its tensors' shapes, strides, offsets
    and dtypes, its other arguments), or None where the result may alias an input (it must be
    computed to share that input's storage) or an argument cannot be compared."""
    schema = getattr(target, "_schema", None)
    if schema is None or schema.is_mutable or target in _HIDDEN_ALIASES:
        return None
    if any(r.alias_info is not None for r in schema.returns):
        return None
    try:
        key = (target, _key_of(args), _key_of(kwargs))
        hash(key)
    except TypeError:
        return None
    return key


def _key_of(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (torch.Tensor, tuple(a.shape), a.stride(), a.storage_offset(), a.dtype)
    if isinstance(a, (list, tuple)):
        return (type(a), tuple(_key_of(x) for x in a))
    if isinstance(a, dict):
        return (dict, tuple((k, _key_of(v)) for k, v in a.items()))
    return (type(a), a)


def _layout(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.dtype)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_layout(x) for x in v))
    if v is None or isinstance(v, (int, float, bool)):
        return (None, v)
    raise TypeError(type(v))


def _rebuild(layout: Any) -> Any:
    """A meta tensor (or structure of them) of a remembered result layout."""
    if isinstance(layout[0], tuple):
        shape, stride, dtype = layout
        return torch.empty_strided(shape, stride, dtype=dtype, device=_META)
    kind, inner = layout
    return inner if kind is None else kind(_rebuild(x) for x in inner)


def val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, Node) else n


def make(
    graph: Graph,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    value: Any = None,
) -> Node:
    """Insert a call at the graph's insertion point, with its fake value computed from its inputs'
    (or ``value``, when the caller already has it: a fake dispatch costs a fraction of a millisecond,
    which adds up over the thousands of nodes a pass on a deep model makes). ``copy_`` is given its
    destination's value, which it returns."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    if value is None and target is torch.ops.aten.copy_.default and isinstance(args[0], Node):
        value = val(args[0])
    if value is not None:
        node.meta["val"] = value
        return node
    fake = next((v for v in _vals(args) if isinstance(v, torch.Tensor)), None)
    mode = getattr(fake, "fake_mode", None)
    if fake is None or mode is None:
        return node
    if target is operator.getitem:
        with mode:
            node.meta["val"] = val(args[0])[args[1]]
        return node
    try:  # the meta kernel on meta tensors sharing the fake values' storage: about 5x cheaper
        out = target(*_map_meta(args), **_map_meta(kwargs))
        node.meta["val"] = _as_fake(out, mode, fake.device)
    except Exception:
        with mode:
            node.meta["val"] = target(*_map_vals(args), **_map_vals(kwargs))
    return node


def _map_meta(a: Any) -> Any:
    """``a`` with each node's fake value as a meta tensor on the same storage."""
    if isinstance(a, Node):
        v = val(a)
        if isinstance(v, FakeTensor):
            m = torch.empty(0, dtype=v.dtype, device=_META)
            return m.set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())
        if isinstance(v, torch.Tensor):
            raise TypeError("a real tensor among fake values")
        return v
    if isinstance(a, (list, tuple)):
        return type(a)(_map_meta(x) for x in a)
    if isinstance(a, dict):
        return {k: _map_meta(v) for k, v in a.items()}
    if isinstance(a, torch.device):
        raise TypeError("a device argument: the result's device is the op's to say")
    return a


def _as_fake(v: Any, mode: Any, device: torch.device) -> Any:
    if isinstance(v, torch.Tensor):
        return FakeTensor(mode, v, device)
    if isinstance(v, (list, tuple)):
        return type(v)(_as_fake(x, mode, device) for x in v)
    return v


def _vals(args: Any) -> list[Any]:
    """The fake values of ``args``' nodes, flattened (a multi-output op's value is a list: the
    fake mode of a ``getitem`` of it is its tensors')."""
    if isinstance(args, (list, tuple)):
        return [v for a in args for v in _vals(a)]
    v = val(args)
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _map_vals(a: Any) -> Any:
    if isinstance(a, Node):
        return val(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_map_vals(x) for x in a)
    if isinstance(a, dict):
        return {k: _map_vals(v) for k, v in a.items()}
    return a


def alias_source(n: Node) -> Node | None:
    """The input whose storage ``n``'s result may share if it aliases one: an out= op's ``out``
    argument, else its first input."""
    into = n.kwargs.get("out")
    if isinstance(into, Node):
        return into
    return n.all_input_nodes[0] if n.all_input_nodes else None


def aliases_input(n: Node) -> bool:
    """Whether ``n``'s result may share storage with one of its inputs (a view, an in-place op)."""
    if n.op != "call_function":
        return n.op in ("placeholder", "get_attr")  # not the program's own buffers
    target = n.target
    index = 0
    if target is operator.getitem:
        src = n.args[0]
        assert isinstance(src, Node)
        if src.op != "call_function" or src.target is operator.getitem:
            return True
        target, index = src.target, int(n.args[1])  # type: ignore[arg-type]
    if target in _HIDDEN_ALIASES:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True  # unknown: assume the worst
    returns = schema.returns
    if not returns:  # an op returning nothing (send) aliases nothing
        return False
    ret = returns[min(index, len(returns) - 1)]
    return ret.alias_info is not None


def is_fresh(n: Node) -> bool:
    """A buffer the program allocated and nothing else sees: it may be reused in place."""
    return not aliases_input(n)


def mutates(n: Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable


def outputs(gm: GraphModule) -> set[Node]:
    """The nodes a program returns."""
    return {a for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}


def mesh_axis_size(kwargs: dict[str, Any]) -> int:
    from collectives.ops import mesh_of

    return mesh_of(kwargs["mesh"]).axis_size(tuple(kwargs["axis"].split(",")))


def param_views(x: Node) -> list[Node] | None:
    """The view ops between a program input and ``x`` (outermost last), or None when ``x`` is not
    a view of an input: such a value is ready from the program's start."""
    chain: list[Node] = []
    while x.op == "call_function":
        inputs = x.all_input_nodes
        if len(inputs) != 1 or not aliases_input(x) or mutates(x):
            return None
        chain.append(x)
        x = inputs[0]
    return chain[::-1] if x.op == "placeholder" else None


def lift_param_views(graph: Graph, xs: Sequence[Node]) -> Node | None:
    """Move the views of program inputs among ``xs`` to the program start (after the inputs, before
    everything else), so what consumes them may be issued there too; returns the last node there."""
    anchor = None
    for n in graph.nodes:
        if n.op == "placeholder":
            anchor = n
    if anchor is None:
        return None
    done: set[Node] = set()
    for x in xs:
        for v in param_views(x) or []:
            if v not in done:
                anchor.append(v)
                anchor = v
                done.add(v)
    return anchor
