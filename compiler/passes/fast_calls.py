"""Fast calls: the eager runtime's program calls tensor methods and ``torch`` functions where the
graph names ATen overloads.

Why: an ``OpOverload`` call goes through Python (``OpOverload.__call__``, then the binding), about
2.5 µs on this project's CPU for a ``view`` or ``reshape``, where ``x.view(...)`` takes 0.9 µs and
``x.contiguous()`` of a dense tensor 0.1 µs. A GPT step's per-rank program is mostly such calls
(about 680 of 930 nodes in the 4-layer example's DP step are views, slices and no-op
``contiguous``), so their overhead is a measurable share of a step whose kernels run at parity with
eager PyTorch. The method or function reaches the same ATen op with the same arguments: only the
Python route to it changes, so results are bit for bit the same.

Only overloads whose Python form resolves to that very overload are rewritten, and only when the
node's arguments are ones the Python form takes as they are; any other node keeps its overload.
Run last, on the program a real mesh's eager runtime calls (after ``held.py``): the planning passes
and the memory model read the overloads, which this pass leaves to them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import copy_module

aten = torch.ops.aten

# overload -> tensor method of the same name, schema and semantics (positional arguments only)
METHODS: dict[Any, str] = {
    aten.view.default: "view",
    aten.reshape.default: "reshape",
    aten.t.default: "t",
    aten.transpose.int: "transpose",
    aten.permute.default: "permute",
    aten.unsqueeze.default: "unsqueeze",
    aten.squeeze.dim: "squeeze",
    aten.select.int: "select",
    aten.unbind.int: "unbind",
    aten.split_with_sizes.default: "split_with_sizes",
    aten.expand.default: "expand",
    aten.contiguous.default: "contiguous",
    aten.copy_.default: "copy_",
}
# overload -> torch function that resolves to it for these arguments (the keywords below passed on)
FUNCTIONS: dict[Any, Any] = {
    aten.mm.default: torch.mm,
    aten.mm.out: torch.mm,
    aten.addmm.default: torch.addmm,
    aten.addmm.out: torch.addmm,
    aten.bmm.default: torch.bmm,
    aten.bmm.out: torch.bmm,
    aten.add.Tensor: torch.add,
    aten.add.out: torch.add,
}
# keywords each function's Python form names as the overload does
_KEYWORDS = {"out", "beta", "alpha"}


def fast_calls(gm: GraphModule) -> GraphModule:
    """``gm`` with its view, slice and matmul overloads called the fast way (see the module doc);
    ``gm`` itself when no node qualifies."""
    if not any(_rewritable(n) for n in gm.graph.nodes):
        return gm
    new = copy_module(gm)
    for node in list(new.graph.nodes):
        if _rewritable(node):
            _rewrite(new, node)
    new.graph.lint()
    new.recompile()
    return new


def _rewritable(n: Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target in METHODS:
        return not n.kwargs and isinstance(n.args[0], Node)
    if n.target in FUNCTIONS:
        return set(n.kwargs) <= _KEYWORDS
    return n.target is aten.slice.Tensor and _slice_index(n) is not None


def _rewrite(gm: GraphModule, node: Node) -> None:
    graph = gm.graph
    with graph.inserting_before(node):
        if node.target in METHODS:
            fast = graph.call_method(METHODS[node.target], node.args)
        elif node.target in FUNCTIONS:
            fast = graph.call_function(FUNCTIONS[node.target], node.args, dict(node.kwargs))
        else:
            fast = graph.call_function(operator.getitem, (node.args[0], _slice_index(node)))
    fast.meta = dict(node.meta)
    node.replace_all_uses_with(fast)
    graph.erase_node(node)


_LOWEST = -(2**62)  # indexing warns for bounds near int64's minimum; below -size both clamp to 0


def _slice_index(n: Node) -> Any:
    """The Python index equal to ``aten.slice.Tensor(x, dim, start, end, step)`` (basic indexing
    clamps and wraps start and end as the op does), or None where the node's dim or bounds are not
    plain integers."""
    x, dim, start, end, step = (list(n.args) + [0, None, None, 1][len(n.args) - 1 :])[:5]
    if n.kwargs or not isinstance(x, Node) or not isinstance(dim, int) or dim < 0:
        return None
    if not all(v is None or type(v) is int for v in (start, end)) or type(step) is not int or step < 1:
        return None
    lo, hi = (max(v, _LOWEST) if isinstance(v, int) else None for v in (start, end))
    piece = slice(lo, hi, None if step == 1 else step)
    return piece if dim == 0 else (*([slice(None)] * dim), piece)
