"""``sharded(..., backend="inductor")``: each per-rank program's compute runs as Inductor-compiled code.

How: the program is cut at its communication ops (collectives, ``wait``, send/recv, ``local_slice``)
into compute regions, each region a maximal run of consecutive ops between two such cuts. Every
region with enough work is compiled by Inductor (``torch._inductor.compile_fx``: functionalized by
AOTAutograd, fused, C++ code on CPU), once per program object, and the program becomes a driver that
calls the compiled regions and runs the communication ops as before, in the same order.

Why regions rather than one whole-graph compile with torch's traceable functional collectives:

- one design for both modes: a simulated mesh's collectives are Python rendezvous between threads,
  which Inductor cannot compile, and the same per-rank program runs on a simulated and a real mesh;
- the communication schedule stays the one the passes chose (bucket contents, the point each async
  collective is issued and the point it is waited for): Inductor's scheduler is free to reorder and
  to wait early, and a reordering that differs between two ranks' programs (uneven shapes) would
  misorder their collectives;
- our collectives stay ours: uneven and permuted layouts, byte accounting, in-place bucket
  reductions, all unchanged.

What it costs: fusion does not cross a cut. Most of a step's ops are extern kernels (matmuls,
attention, layer norm) that fuse with nothing, so little is lost.

Ops that write into a buffer (``copy_`` of a gradient into its bucket's slice, of a result into a
donated input; ``shardspec::adamw_multi_``, the donated update, torch's fused AdamW kernel) run in
place between regions, as cuts: inside a region functionalization would turn each write into a
rewrite of the whole buffer and a copy back into the region's input. ``shardspec::adamw`` (the
functional update) is decomposed for Inductor into its math (torch.optim.AdamW's single-tensor
formula), so the updates of all parameters fuse into a few loops; ``shardspec::matmul`` has a fake
implementation and runs as an extern kernel; the counter-based random ops are plain ATen integer
math and compile. A region Inductor cannot compile runs eagerly (the rest stays compiled), with one
warning per program naming the region's first op and the reason.

Inputs: Inductor's code is specialized to the strides seen at compile time; a call whose input has
other strides (a simulated shard that is a non-contiguous view) gets a copy at the compiled strides
instead of a failed assertion.
"""

from __future__ import annotations

import operator
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.fx import Graph, GraphModule, Node

from shardspec.errors import fail

BACKENDS = ("eager", "inductor")
MIN_REGION_OPS = 3  # fewer compute ops than this (views between two waits) run eagerly

# ops of our namespace that communicate, depend on the rank or mark the program: never compiled
_CUT_OPS = {
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_reduce_inplace",
    "all_to_all",
    "ppermute",
    "broadcast",
    "send",
    "recv",
    "wait",
    "local_slice",
    "pipeline_boundary",
    "constrain",
}
_VIEW_LIKE = {operator.getitem}

_COMPILED: weakref.WeakKeyDictionary[GraphModule, Callable[..., Any]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_BY_SIGNATURE: dict[Any, torch.nn.Module] = {}  # compiled regions by what they compute (_Region.signature)


def check_backend(backend: Any) -> str:
    """The ``backend=`` argument, validated."""
    if backend not in BACKENDS:
        raise fail(
            f"sharded(backend={backend!r}) is not a backend.",
            f"use one of {', '.join(repr(b) for b in BACKENDS)} ('eager' is the default).",
        )
    return str(backend)


def runner(gm: GraphModule, backend: str) -> Callable[..., Any]:
    """What runs ``gm``: the program itself (eager), or its compiling driver (one per program object)."""
    if backend == "eager":
        return gm
    with _LOCK:
        driver = _COMPILED.get(gm)
        if driver is None:
            driver = _COMPILED[gm] = _Lazy(gm)
    return driver


class _Lazy:
    """The first call runs the program eagerly, recording the shapes and strides each region's
    inputs really have (a fake run cannot know them all: a collective's fake result is block 0's
    size, whatever the rank), then compiles; later calls run the compiled driver. The compile
    happens after this rank's last collective, so no other rank waits on it."""

    def __init__(self, gm: GraphModule) -> None:
        self.gm: GraphModule | None = gm
        self.segments = _segments(gm)
        self.regions = [_Region(seg) if _compilable(seg) else None for seg in self.segments]
        self.driver: GraphModule | None = None

    def __call__(self, *args: Any) -> Any:
        if self.driver is not None:
            return self.driver(*args)
        with _LOCK:  # another rank's thread may have just compiled the same program
            gm, segments, regions, driver = self.gm, self.segments, self.regions, self.driver
        if driver is not None or gm is None:
            return cast(GraphModule, self.driver)(*args)
        needed = {x for r in regions if r is not None for x in r.inputs}
        seen: dict[Node, _Layout] = {}

        class _Record(torch.fx.Interpreter):
            def run_node(self, n: Node) -> Any:
                result = super().run_node(n)
                if n in needed and isinstance(result, torch.Tensor):
                    seen[n] = (tuple(result.shape), tuple(result.stride()), result.dtype, result.device)
                return result

        recorder = _Record(gm)
        recorder.extra_traceback = False  # a ShardingError raised by a collective stays as written
        outs = recorder.run(*args)
        with _LOCK:
            if self.driver is None:
                self.driver = _build(gm, segments, regions, seen)
                # the program's nodes are no longer needed: the cache entry must not keep it alive
                self.gm, self.segments, self.regions = None, [], []
        return outs


_Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def _build(
    gm: GraphModule, segments: list[list[Node]], regions: list[_Region | None], seen: dict[Node, _Layout]
) -> GraphModule:
    """A driver program equal to ``gm``: compute regions compiled, communication ops as they were."""
    graph = Graph()
    env: dict[Node, Node] = {}
    driver_mods: dict[str, torch.nn.Module] = {}
    failures: list[str] = []
    for i, (seg, region) in enumerate(zip(segments, regions, strict=True)):
        compiled = None
        if region is not None:
            try:
                compiled = region.compile(gm, seen)
            except Exception as exc:  # any compiler failure: the region runs eagerly
                first = next((n for n in seg if n.op == "call_function"), seg[0])
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                failures.append(f"region from {first.target} ({type(exc).__name__}: {reason[:200]})")
        if region is None or compiled is None:
            for n in seg:
                env[n] = graph.node_copy(n, lambda x: env[x])
            continue
        for n in seg:  # the region's constants, read by the driver and passed in
            if n.op == "get_attr":
                env[n] = graph.node_copy(n, lambda x: env[x])
        name = f"region_{i}"
        driver_mods[name] = compiled
        call = graph.call_module(name, tuple(env[x] for x in region.inputs))
        for j, out in enumerate(region.outputs):
            env[out] = graph.call_function(operator.getitem, (call, j))
    if failures:
        warnings.warn(
            f"sharded(backend='inductor'): {len(failures)} region(s) of the per-rank program run "
            "eagerly, Inductor could not compile them: " + "; ".join(failures),
            stacklevel=4,
        )
    root = torch.nn.Module()
    for name in _attr_names(gm):
        setattr(root, name, getattr(gm, name))
    for name, mod in driver_mods.items():
        root.add_module(name, mod)
    return GraphModule(root, graph)


def _attr_names(gm: GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "get_attr"]


def _is_cut(n: Node) -> bool:
    """Ops that stay outside compiled regions: communication, and anything not a plain computation."""
    if n.op != "call_function":
        return n.op != "get_attr"  # placeholders and the output; constants feed regions as inputs
    target = n.target
    if not isinstance(target, torch._ops.OpOverload):
        return target not in _VIEW_LIKE
    if target._schema.is_mutable:
        # an op writing into a buffer runs in place as it is: in a region, functionalization would
        # rewrite the whole buffer for each write (a gradient copied into its bucket's slice) and
        # copy it back into a region input; and the donated AdamW update is torch's fused kernel
        return True
    return target.namespace == "shardspec" and target._opname in _CUT_OPS


def _segments(gm: GraphModule) -> list[list[Node]]:
    """The program's nodes in order, grouped: each cut alone, each run between cuts together."""
    out: list[list[Node]] = []
    run: list[Node] = []
    for n in gm.graph.nodes:
        if _is_cut(n):
            if run:
                out.append(run)
                run = []
            out.append([n])
        else:
            run.append(n)
    if run:
        out.append(run)
    return _with_their_getitems(out)


def _with_their_getitems(segments: list[list[Node]]) -> list[list[Node]]:
    """Each multi-output op's ``getitem``s in the op's own run: one that fell after a cut (a layer
    norm's mean read only by a later backward) left the run returning the op's tuple, which a
    compiled region cannot, and the later run starting from that tuple. A getitem is pure and
    reads only its op, so it may run right after it."""
    where = {n: i for i, seg in enumerate(segments) for n in seg}
    moved: set[Node] = set()
    for i, seg in enumerate(segments):
        if len(seg) == 1 and _is_cut(seg[0]):
            continue
        extra = [
            u
            for n in seg
            if isinstance(n.meta.get("val"), (tuple, list))
            for u in n.users
            if u.target is operator.getitem and where.get(u, i) != i and u not in moved
        ]
        moved.update(extra)
        seg.extend(extra)
    out = [[n for n in seg if n not in moved or where[n] != i] for i, seg in enumerate(segments)]
    return [seg for seg in out if seg]


def _compilable(seg: list[Node]) -> bool:
    work = [n for n in seg if n.op == "call_function" and n.target not in _VIEW_LIKE]
    return not _is_cut(seg[0]) and len(work) >= MIN_REGION_OPS


class _Region:
    """A run of compute ops: its inputs (values from before it) and outputs (values used after it)."""

    def __init__(self, seg: list[Node]) -> None:
        # a constant (get_attr) is an input, not part of the code: a region is reused by what it
        # computes (another layer's, another program's), and a constant baked in would come along
        self.nodes = [n for n in seg if n.op != "get_attr"]
        inside = set(self.nodes)
        self.inputs: list[Node] = []
        seen: set[Node] = set()
        for n in seg:
            for x in n.all_input_nodes:
                if x not in inside and x not in seen:
                    seen.add(x)
                    self.inputs.append(x)
        self.outputs = [n for n in seg if any(u not in inside for u in n.users)]

    def compile(self, gm: GraphModule, seen: dict[Node, _Layout]) -> torch.nn.Module | None:
        """The region as an Inductor-compiled module, or None when it returns nothing. A region
        equal to one compiled before (the same ops on inputs of the same layouts: another layer, another
        microbatch, another rank's program) reuses its code."""
        if not self.outputs:
            return None
        missing = [x.name for x in self.inputs if x not in seen]
        if missing:
            raise TypeError(f"region inputs {missing} are not tensors")
        key = self.signature(seen)
        done = _BY_SIGNATURE.get(key)
        if done is not None:
            return done
        graph = Graph()
        env: dict[Node, Node] = {}
        for x in self.inputs:
            env[x] = graph.placeholder(x.name)
        for n in self.nodes:
            env[n] = graph.node_copy(n, lambda x: env[x])
        graph.output(tuple(env[n] for n in self.outputs))
        sub = GraphModule(gm, graph)
        from torch._inductor.compile_fx import compile_fx
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            example = [
                torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in (seen[x] for x in self.inputs)
            ]
        with torch.no_grad():
            fn = compile_fx(sub, example, decompositions=_decompositions())
        del mode
        done = _BY_SIGNATURE[key] = _Compiled(cast(Callable[..., Any], fn), [seen[x][1] for x in self.inputs])
        return done

    def signature(self, seen: dict[Node, _Layout]) -> tuple[Any, ...]:
        """What the compiled code depends on: the ops in order, their arguments with values named
        by position, which values are returned, and the inputs' layouts."""
        pos = {x: i for i, x in enumerate([*self.inputs, *self.nodes])}

        def arg(a: Any) -> Any:
            if isinstance(a, Node):
                return ("node", pos[a])
            if isinstance(a, (list, tuple)):
                return (type(a).__name__, *(arg(x) for x in a))
            if isinstance(a, dict):
                return ("dict", *sorted((k, arg(v)) for k, v in a.items()))
            return repr(a)

        ops = tuple((str(n.target), arg(n.args), arg(n.kwargs)) for n in self.nodes)
        return ops, tuple(pos[n] for n in self.outputs), tuple(seen[x] for x in self.inputs)


class _Compiled(torch.nn.Module):
    """A compiled region; inputs whose strides differ from the compiled ones are copied to them."""

    def __init__(self, fn: Callable[..., Any], strides: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.fn = fn
        self.strides = strides

    def forward(self, *args: torch.Tensor) -> Any:
        fixed = list(args)
        for i, (x, want) in enumerate(zip(args, self.strides, strict=True)):
            if x.stride() != want:
                fixed[i] = torch.empty_strided(x.shape, want, dtype=x.dtype, device=x.device).copy_(x)
        return self.fn(*fixed)


def _decompositions() -> dict[Any, Callable[..., Any]]:
    """Ours that Inductor should see through: AdamW's update as elementwise math it can fuse."""
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    table[torch.ops.shardspec.adamw.default] = _adamw_math
    return table


def _adamw_math(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch.optim.AdamW's single-tensor update, out of place (the op's kernel, as traceable math)."""
    t = step.to(torch.float64)
    m_new = torch.lerp(m, g, 1 - beta1)
    v_new = v * beta2 + (1 - beta2) * g * g
    bias1 = 1 - torch.pow(beta1, t)
    bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, t))
    denom = torch.sqrt(v_new) / bias2_sqrt.to(v.dtype) + eps
    p_new = p * (1 - lr * weight_decay) - (lr / bias1).to(p.dtype) * m_new / denom
    return p_new, m_new, v_new
