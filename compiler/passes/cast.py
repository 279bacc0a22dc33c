"""Cast: mixed precision's communication. Two rewrites of where a dtype conversion sits around a
collective, both exact in what they compute or chosen by the user:

1. Cast before communicate. An all-gather whose every reader casts its result to one narrower
   floating dtype (``p.to(torch.bfloat16)`` on an fp32 master parameter gathered whole) gathers
   the cast shard instead: casting commutes with concatenation, so the result is bit-identical,
   and the gather sends half the bytes (bf16 travels, not fp32).
2. Gradient reduction dtype (``passes={"reduce_dtype": torch.bfloat16}`` or ``torch.float32``).
   A reduce-scatter or all-reduce of a gradient (a value computed in backward) in another
   floating dtype is run in ``reduce_dtype``: when the gradient is an upcast of a value in
   ``reduce_dtype`` (bf16 compute, fp32 master), the narrow value is reduced and the result upcast;
   otherwise the value is cast, reduced and cast back. bf16 halves the bytes and rounds each
   partial sum to 8 bits of mantissa; fp32 sums bf16 gradients without that rounding (FSDP's
   ``MixedPrecisionPolicy(reduce_dtype=...)``).

A rewritten collective is reported under its original name with ``@cast:<dtype>``, so
``Lowered.collectives()`` and ``cost()`` count the bytes in the dtype that travels.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import copy_module, make
from compiler.passes.regather import BACKWARD
from compiler.propagate_state import _VIEW_LIKE

aten, prims, ops = torch.ops.aten, torch.ops.prims, torch.ops.shardspec
CASTS = {aten._to_copy.default, prims.convert_element_type.default}
REDUCTIONS = {ops.reduce_scatter.default, ops.all_reduce.default}
AGAIN = "@cast:"  # a launch member "<collective>@cast:bfloat16" is that collective in bfloat16


def cast(gm: GraphModule, reduce_dtype: torch.dtype | None = None) -> GraphModule:
    """The program with casts moved before gathers, and gradient reductions in ``reduce_dtype``."""
    gm = copy_module(gm)
    cast_(gm, reduce_dtype)
    gm.recompile()
    return gm


def cast_(gm: GraphModule, reduce_dtype: torch.dtype | None = None) -> None:
    graph = gm.graph
    for g in [n for n in graph.nodes if n.op == "call_function" and n.target is ops.all_gather.default]:
        _cast_before_gather(gm, g)
    if reduce_dtype is not None:
        for c in [n for n in graph.nodes if n.op == "call_function" and n.target in REDUCTIONS]:
            _reduce_in(gm, c, reduce_dtype)
    graph.lint()


def cast_target(n: Node) -> torch.dtype | None:
    """The dtype a pure dtype conversion converts to (None: not one)."""
    if n.op != "call_function" or n.target not in CASTS:
        return None
    if n.target is prims.convert_element_type.default:
        return n.args[1]  # type: ignore[return-value]
    extra = set(n.kwargs) - {"dtype"}
    if extra or len(n.args) != 1:  # a copy to another device or layout is more than a cast
        return None
    return n.kwargs.get("dtype")  # type: ignore[return-value]


def _dtype(n: object) -> torch.dtype | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def _name(n: Node, dtype: torch.dtype) -> list[str]:
    base = n.meta.get("shardspec_members", [n.name])
    return [m.split(AGAIN)[0] + AGAIN + str(dtype).replace("torch.", "") for m in base]


def _cast_before_gather(gm: GraphModule, g: Node) -> None:
    src = g.args[0]
    have = _dtype(g)
    targets = {cast_target(u) for u in g.users}
    if not g.users or len(targets) != 1 or not isinstance(src, Node) or have is None:
        return
    want = targets.pop()
    if want is None or not want.is_floating_point or not have.is_floating_point:
        return
    if torch.finfo(want).bits >= torch.finfo(have).bits:
        return  # only a narrowing cast saves bytes
    with gm.graph.inserting_before(g):
        narrow = make(gm.graph, prims.convert_element_type.default, (src, want))
        moved = make(gm.graph, g.target, (narrow,), dict(g.kwargs))
    moved.meta.update({k: v for k, v in g.meta.items() if k != "val"})
    moved.meta["shardspec_members"] = _name(g, want)
    for u in list(g.users):
        u.replace_all_uses_with(moved)
        gm.graph.erase_node(u)
    gm.graph.erase_node(g)


def _is_gradient(x: Node) -> bool:
    """Computed in backward (through views and casts of such a value). Only those: a value computed
    from a gradient (a norm's sum of squares for clipping) is not one, and keeps its dtype."""
    while not x.meta.get(BACKWARD):
        if x.op != "call_function" or len(x.all_input_nodes) != 1 or not _passes_through(x):
            return False
        x = x.all_input_nodes[0]
    return True


def _passes_through(x: Node) -> bool:
    """A view, a cast, or a scaling by a number (an SGD update's ``lr * g``, a mean's ``g / k``):
    the caller checked that ``x`` reads one tensor, so the other operand is a constant."""
    return x.target in _VIEW_LIKE or x.target in (
        prims.convert_element_type.default,
        aten.reshape.default,
        aten.contiguous.default,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.neg.default,
    )


def _reduce_in(gm: GraphModule, c: Node, dtype: torch.dtype) -> None:
    x = c.args[0]
    have = _dtype(c)
    if not isinstance(x, Node) or have is None or have == dtype or not have.is_floating_point:
        return
    if c.kwargs.get("op", "sum") not in ("sum", "avg") or not _is_gradient(x):
        return
    graph = gm.graph
    with graph.inserting_before(c):
        inner = x.all_input_nodes[0] if cast_target(x) == dtype and x.all_input_nodes else None
        narrow = inner if inner is not None else make(graph, prims.convert_element_type.default, (x, dtype))
        reduced = make(graph, c.target, (narrow,), dict(c.kwargs))
    reduced.meta.update({k: v for k, v in c.meta.items() if k != "val"})
    reduced.meta["shardspec_members"] = _name(c, dtype)
    with graph.inserting_after(reduced):
        back = make(graph, prims.convert_element_type.default, (reduced, have))
    c.replace_all_uses_with(back)
    graph.erase_node(c)
    if inner is not None and not x.users:
        graph.erase_node(x)
