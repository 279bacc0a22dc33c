"""Stage assignment: which pipeline stage, microbatch and kind each node of the traced step is.

Boundaries cut the step into segments: forward cut ``k``'s output starts segment ``k + 1``; other
forward nodes join the latest segment among their operands. Backward cut ``k``'s output is segment
``k``; other backward nodes join the earliest segment among the gradients they read (a gradient
flows to earlier segments only), or, reading no gradient, the latest among their operands. Nodes
reading only parameters and constants (a transpose of a weight, the batch split into microbatches)
take the segment of their users (for a cut: the side it reads from). With more cuts than stages,
the segments are grouped into ``S`` contiguous stages minimizing the largest stage cost (linear
partition over the segments' FLOPs and bytes). A node is forward (``F``) or backward (``B``) by
the order ``value_and_grad`` runs them (a microbatch's forward, then its backward); nodes outside
any microbatch (the accumulation, the optimizer) are ``T``, run on their stage once their inputs are there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from compiler.grad import CALL, MICROBATCH
from compiler.pipeline.boundary import BOUNDARY
from compiler.sources import source_of
from shardspec.errors import fail

_MATMULS = ("aten.mm.", "aten.bmm.", "shardspec.matmul.", "aten.convolution")


@dataclass(frozen=True)
class Label:
    stage: int
    mb: int  # -1 outside any microbatch
    kind: str  # "F", "B" or "T"


@dataclass(frozen=True)
class StagePlan:
    labels: dict[str, Label]  # traced node name -> label (placeholders: their first user's stage)
    inputs: dict[str, frozenset[int]]  # placeholder name -> stages that read it
    stages: int
    microbatches: int
    cuts: tuple[int, ...]  # the boundaries that became stage cuts (cut numbers)
    segment_cost: tuple[float, ...]  # per segment (between consecutive boundaries), FLOPs + bytes
    stage_cost: tuple[float, ...]

    @property
    def balance(self) -> float:
        """Largest stage cost over the mean (1.0 = perfectly balanced)."""
        mean = sum(self.stage_cost) / len(self.stage_cost)
        return max(self.stage_cost) / mean if mean else 1.0


def node_cost(n: Node) -> float:
    """FLOPs plus bytes written: matmuls count 2 * M * N * K, other ops one FLOP per element."""
    vals = n.meta.get("val")
    outs = [v for v in (vals if isinstance(vals, (tuple, list)) else [vals]) if isinstance(v, torch.Tensor)]
    written = sum(v.numel() * v.element_size() for v in outs)
    elems = sum(v.numel() for v in outs)
    if str(n.target).startswith(_MATMULS) and n.args and isinstance(n.args[0], Node):
        a = n.args[0].meta.get("val")
        k = a.shape[-1] if isinstance(a, torch.Tensor) and a.dim() else 1
        return 2.0 * elems * k + written
    return float(elems + written)


def _microbatch(n: Node) -> int:
    custom = n.meta.get("custom") or {}
    return int(custom.get(MICROBATCH, -1))


def _backward_flags(nodes: Sequence[Node]) -> dict[Node, bool]:
    """A microbatch's nodes from its first backward-labelled node on are its backward."""
    started: set[int] = set()
    out = {}
    for n in nodes:
        mb = _microbatch(n)
        if mb >= 0 and (
            source_of(n).startswith("backward of ") or (n.target is BOUNDARY and n.kwargs["backward"])
        ):
            started.add(mb)
        out[n] = mb >= 0 and mb in started
    return out


def segments(module: GraphModule) -> tuple[dict[Node, int | None], dict[Node, bool], int]:
    """Each node's segment (None: reads only parameters and constants, placed by its users), the
    backward flags and the number of cuts."""
    nodes = list(module.graph.nodes)
    backward = _backward_flags(nodes)
    cuts_seen = [int(n.kwargs["cut"]) for n in nodes if n.target is BOUNDARY and not n.kwargs["backward"]]
    ncuts = 1 + max(cuts_seen) if cuts_seen else 0
    seg: dict[Node, int | None] = {}
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            seg[n] = None
            continue
        ins = [seg[a] for a in n.all_input_nodes if seg.get(a) is not None]
        if n.target is BOUNDARY:
            k = int(n.kwargs["cut"])
            seg[n] = k if n.kwargs["backward"] else k + 1
            src = seg.get(n.all_input_nodes[0])
            if not n.kwargs["backward"] and src is not None and src > k:
                raise fail(
                    f"pipeline_boundary #{k} at {source_of(n)} reads a value computed after boundary "
                    f"#{src - 1}: boundaries must be met in order along the forward.",
                    "call pipeline_boundary on the activation flowing from one group of layers to the next.",
                )
            continue
        if backward[n]:
            grads = [seg[a] for a in n.all_input_nodes if backward.get(a) and seg.get(a) is not None]
            seg[n] = min(grads) if grads else (max(ins) if ins else None)  # type: ignore[type-var]
        else:
            seg[n] = max(ins) if ins else None  # type: ignore[type-var]
    for n in reversed(nodes):  # nodes reading only inputs and constants: their users' segment
        if seg[n] is None and n.op == "call_function":
            users = [s for u in n.users if (s := _side(u, seg)) is not None]
            seg[n] = min(users) if users else None
    return seg, backward, ncuts


def _side(user: Node, seg: dict[Node, int | None]) -> int | None:
    """The segment a value read by ``user`` belongs to: a forward cut k reads from segment k, a
    backward cut k from segment k + 1, any other node from its own."""
    if user.target is BOUNDARY:
        k = int(user.kwargs["cut"])  # type: ignore[arg-type]
        return k + 1 if user.kwargs["backward"] else k
    return seg.get(user)


def linear_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Group ``costs`` into ``parts`` contiguous runs minimizing the largest run's sum; returns the
    first index of each run after the first (the chosen cuts)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], choice[k][i] = v, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = choice[k][i]
        starts.append(i)
    return sorted(starts)[1:]


def _fewer_virtual(stages: int, virtual: int, ncuts: int) -> str:
    """The interleaved schedule's other way out: fewer virtual stages per position."""
    if virtual <= 1:
        return ""
    fits = (ncuts + 1) // (stages // virtual)
    if fits >= 2:
        return f", or lower virtual_stages from {virtual} to {fits} (Pipeline(..., virtual_stages={fits}))"
    return f", or lower virtual_stages from {virtual} to 1 with a non-interleaved schedule ('1f1b')"


def assign(module: GraphModule, stages: int, microbatches: int, virtual: int = 1) -> StagePlan:
    """Label every traced node with (stage, microbatch, kind), or explain why the cuts cannot make
    ``stages`` stages (``virtual`` stages per position: the interleaved schedule's)."""
    calls = {(n.meta.get("custom") or {}).get(CALL) for n in module.graph.nodes} - {None}
    if len(calls) > 1:
        raise fail(
            f"a pipelined step takes its gradients once, but it calls shardspec.value_and_grad "
            f"{len(calls)} times: the schedule interleaves one set of microbatches.",
            "compute loss and gradients with one value_and_grad(loss_fn, microbatches=m) call per "
            "step (run further updates as further steps).",
        )
    seg, backward, ncuts = segments(module)
    if ncuts + 1 < stages:
        raise fail(
            f"the pipeline needs {stages} stages but the step has {ncuts} pipeline_boundary call(s) per "
            f"microbatch, which cut it into {ncuts + 1}.",
            f"call shardspec.pipeline_boundary(x) at least {stages - 1} times in the model's forward "
            "(between layers), or use a smaller pipeline axis" + _fewer_virtual(stages, virtual, ncuts) + ".",
        )
    cost = [0.0] * (ncuts + 1)
    for n, s in seg.items():
        if s is not None and n.op == "call_function" and _microbatch(n) == 0:
            cost[s] += node_cost(n)
    starts = linear_partition(cost, stages)
    group = [sum(1 for st in starts if st <= i) for i in range(ncuts + 1)]
    stage_cost = [0.0] * stages
    for i, c in enumerate(cost):
        stage_cost[group[i]] += c
    labels: dict[str, Label] = {}
    inputs: dict[str, set[int]] = {}
    work = [0] * stages
    for n, s in seg.items():
        if n.op == "placeholder":
            inputs[n.name] = {group[seg[u]] for u in n.users if seg.get(u) is not None}  # type: ignore[index]
        if n.op != "call_function":
            continue
        stage = group[s] if s is not None else 0
        mb = _microbatch(n)
        kind = "T" if mb < 0 else ("B" if backward[n] else "F")
        labels[n.name] = Label(stage, mb, kind)
        if mb >= 0 and n.target is not BOUNDARY:
            work[stage] += 1
    idle = [i for i, w in enumerate(work) if w == 0]
    for n in seg:  # a boundary on an input (a parameter) cuts nothing: say so before "no work"
        if idle and n.target is BOUNDARY and not n.kwargs.get("backward") and _is_input(n.args[0]):
            raise fail(
                f"pipeline_boundary at {source_of(n) or n.name} is applied to an input of the step "
                f"(a parameter or batch argument), not to an activation: pipeline stage {idle[0]} has "
                "no work.",
                "put pipeline_boundary(h) on the activation passed from one layer to the next.",
            )
    if idle:
        raise fail(
            f"pipeline stage {idle[0]} has no work: its boundaries enclose no computation (stage costs "
            f"{[round(c) for c in stage_cost]}).",
            "remove the extra pipeline_boundary, or put layers between consecutive boundaries.",
        )
    return StagePlan(
        labels,
        {k: frozenset(v) for k, v in inputs.items()},
        stages,
        microbatches,
        tuple(starts[i] - 1 for i in range(len(starts))),
        tuple(cost),
        tuple(stage_cost),
    )


_PASS_THROUGH = {torch.ops.aten.view.default, torch.ops.aten.alias.default, torch.ops.aten.detach.default}


def _is_input(x: object) -> bool:
    """Whether ``x`` is a placeholder, or an alias of one (what a parameter is in the trace)."""
    while isinstance(x, Node) and x.op == "call_function" and x.target in _PASS_THROUGH:
        x = x.args[0]
    return isinstance(x, Node) and x.op == "placeholder"
