"""Slice early: a ``local_slice`` (this rank's block of a whole value, no communication) runs right
after the value it slices is computed, not where its reader is.

Propagation may compute a gradient whole on every rank (gathering two small activations is cheaper
than reduce-scattering a large weight gradient) and slice out this rank's block where the optimizer
reads it, at the end of the step. Placed at its reader, the slice keeps every such whole gradient
alive through the rest of backward: model-sized memory that ZeRO-3 exists to avoid. Moved next to
its input, the whole value dies at once (when nothing else reads it) and only the block is held.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from compiler.passes.graph import copy_module

ops = torch.ops.shardspec


def slice_early(gm: GraphModule) -> GraphModule:
    """The program with each local slice moved right after its input (see the module doc)."""
    gm = copy_module(gm)
    slice_early_(gm)
    gm.recompile()
    return gm


def slice_early_(gm: GraphModule) -> None:
    for n in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.local_slice.default]:
        inputs = n.all_input_nodes
        if len(inputs) == 1 and inputs[0].op == "call_function":
            inputs[0].append(n)
    gm.graph.lint()
