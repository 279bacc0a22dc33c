"""In-place all-reduce: ``all_reduce`` allocates its result and copies its input into it, because a
functional op may not touch its input. When the input is a buffer the program made and nothing else
reads (a gradient whose only use is this reduction), reducing it where it lies gives the same values
with no allocation and no copy.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import copy_module, is_fresh, outputs

ops = torch.ops.shardspec


def inplace(gm: GraphModule) -> GraphModule:
    """``all_reduce(x)`` -> ``all_reduce_inplace(x)`` where ``x`` is fresh and used only there."""
    gm = copy_module(gm)
    inplace_(gm)
    gm.recompile()
    return gm


def inplace_(gm: GraphModule) -> None:
    results = outputs(gm)
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not ops.all_reduce.default:
            continue
        x = n.args[0]
        if not isinstance(x, Node) or len(x.users) != 1 or x in results or not is_fresh(x):
            continue
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(ops.all_reduce_inplace.default, (x,), dict(n.kwargs))
        new.meta = dict(n.meta)
        new.meta.setdefault("shardspec_members", [n.name])
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
