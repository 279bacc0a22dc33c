"""Held buckets: a gradient all-reduce's flat buffer is allocated once and reused by every call.

DDP keeps its gradient buckets from one step to the next. A program that allocates its 25 MiB bucket
afresh each call pays for it twice on a CPU: the allocator maps new pages, which the kernel zeroes
on first touch (about 7% of a DP step of the example GPT on two gloo processes), and freeing the
large block raises glibc's mmap threshold, after which the step's smaller buffers come from a heap
that fragments (the resident set grows about 13 MiB beyond the step's live bytes). A held buffer
avoids both; the rank holds the bucket between calls, as DDP does (the gradients are model state
in ZeRO's count, 16Ψ for DP, so the formulas do not change).

Applies to ``arena.py``'s buffer and to the flat buckets ``pack_early`` makes for an
``all_reduce_inplace`` (DP's and ZeRO-1's full gradients) whose storage no result of the program
shares: a result in a held buffer would be overwritten by the next call. Reduce-scatter buckets stay
per call: holding every one of them would keep the full gradients that ZeRO-2 and ZeRO-3 free. Only
for a real mesh's process, which runs its rank's program alone: a simulated mesh runs one program
object from every rank's thread.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from compiler.passes.arena import ARENA
from compiler.passes.graph import copy_module
from compiler.passes.liveness import result_roots

aten = torch.ops.aten
ops = torch.ops.shardspec


class HeldBuffer(torch.nn.Module):
    """``like.new_empty(size)`` on the first call; the same tensor on every later call (a new one if
    the size, dtype or device ever differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[torch.Tensor] = []

    def forward(self, like: torch.Tensor, size: list[int]) -> torch.Tensor:
        if self.held:
            buf = self.held[0]
            if list(buf.shape) == list(size) and buf.dtype == like.dtype and buf.device == like.device:
                return buf
            self.held.clear()
        self.held.append(like.new_empty(size))
        return self.held[0]


def hold_buckets(gm: GraphModule) -> GraphModule:
    """The program with its all-reduce buckets held between calls (see the module doc); ``gm``
    itself when none qualifies."""
    chosen = [n for n in gm.graph.nodes if _holdable(n)]
    if not chosen:
        return gm
    escaping = result_roots(gm)
    chosen = [n for n in chosen if n not in escaping]
    if not chosen:
        return gm
    new = copy_module(gm)
    by_name = {n.name: n for n in new.graph.nodes}
    for k, old in enumerate(chosen):
        node = by_name[old.name]
        name = f"held_bucket_{k}"
        new.add_submodule(name, HeldBuffer())
        with new.graph.inserting_before(node):
            held = new.graph.call_module(name, node.args)
        held.meta = dict(node.meta)
        node.replace_all_uses_with(held)
        new.graph.erase_node(node)
    new.graph.lint()
    new.recompile()
    return new


def _holdable(n: Node) -> bool:
    if not (n.op == "call_function" and n.target is aten.new_empty.default and not n.kwargs):
        return False
    if n.meta.get(ARENA):
        return True
    if not n.meta.get("shardspec_flat_bucket"):
        return False
    users = list(n.users)
    while len(users) == 1 and users[0].target is aten.reshape.default:
        users = list(users[0].users)
    return any(u.target is ops.all_reduce_inplace.default for u in users)
