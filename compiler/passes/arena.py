"""Arena: the step's large intermediate values computed into one buffer held between calls.

Why: a CPU step allocates its activations and gradients from malloc on every call, and glibc hands
the top of its heap back to the kernel whenever more than its trim threshold lies free there; every
page handed back is zeroed again at its next first touch. The example GPT's step on one process
took 1,300 to 1,800 page faults a call (3 to 6 ms of kernel time, 4 to 6% of the step) where the
eager ``nn.Module`` step's settled at none. The program is known whole, so each value's size and
lifetime are too: the values that would come and go through malloc get fixed places in one buffer,
allocated on the first call and reused by every later one (``held.py``), as the held gradient
buckets are. What the rank holds between calls grows by the arena; its peak does not (the same
values were live at the same time before, now at planned offsets, each aligned to 64 bytes).

The values taken are those ``colocate`` would take (at least 64 KiB, contiguous, not a result, not
aliasing an input, an op whose ``out=`` overload takes the same arguments), placed first fit in
program order among the values live at the same time (``colocate.place`` with no region written).
One arena per dtype and device. Only where the runtime holds buffers (a real mesh's eager runtime):
a simulated mesh runs one program object from every rank's thread. Not in a program that
reduce-scatters gradients (ZeRO-2 and ZeRO-3): those split state to hold less between calls, which an
arena would undo (and on them the placement's peak exceeded the scattered buffers' by up to 0.4 MiB).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from compiler.passes import liveness
from compiler.passes.colocate import Region, Value, candidate, into_slice, place
from compiler.passes.graph import make, val

aten = torch.ops.aten
ARENA = "shardspec_arena"
# a program that reduce-scatters gradients (ZeRO-2, ZeRO-3) trades time for memory: it gets no arena
_SHEDS_STATE = {torch.ops.shardspec.reduce_scatter.default}
ALIGN = 64  # bytes: each value starts on a cache line, as the allocator's own blocks do


def arena_(gm: GraphModule) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    if any(n.target in _SHEDS_STATE for n in nodes):
        return  # ZeRO-2/3: state is split to keep memory down; an arena would hold a step's worth
    pos = {n: i for i, n in enumerate(nodes)}
    root = liveness.roots(nodes, may_alias=True)  # a value's reads through anything aliasing it
    last = liveness.last_reads(nodes, root)
    escaping = liveness.result_roots(gm)
    groups: dict[tuple[torch.dtype, torch.device], list[Node]] = {}
    for n in nodes:
        v = val(n)
        if isinstance(v, torch.Tensor) and candidate(n, root, escaping, v.dtype, v.device):
            groups.setdefault((v.dtype, v.device), []).append(n)
    for (dtype, device), chosen in groups.items():
        like = next((n for n in nodes if n.op == "placeholder" and _is(val(n), dtype, device)), None)
        if like is None or len(chosen) < 2:
            continue  # nothing to make the arena like, or nothing to share it
        step = max(1, ALIGN // torch.empty((), dtype=dtype).element_size())
        values = [Value(-(-val(n).numel() // step) * step, pos[n], last.get(n, pos[n])) for n in chosen]
        total = sum(v.numel for v in values)
        offsets = place(values, [Region(0, total, len(nodes))], total)
        size = max(o + v.numel for o, v in zip(offsets, values, strict=True) if o is not None)
        first = next(n for n in nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            buf = make(graph, aten.new_empty.default, (like, [size]))
        buf.meta[ARENA] = True
        for n, offset in zip(chosen, offsets, strict=True):
            if offset is not None:
                into_slice(graph, n, buf, offset)
    graph.lint()


def _is(v: object, dtype: torch.dtype, device: torch.device) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == dtype and v.device == device
