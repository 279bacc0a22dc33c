"""The global planner: choose every op's sharding for the whole step under one cost model.

Greedy propagation (``compiler/propagate.py``) decides op by op; a local tie or saving can cost the
whole step (ZeRO-3 gathering the batch instead of the weights turns an MLP into tensor parallelism
over the data axis). ``plan_globally`` takes the greedy result as its warm start and floor:
per-op candidates (``candidates.py``), reshard seconds on edges and compute seconds on ops
(``costmodel.py``), one integer program (``solve.py``); the answer is kept only when its modeled
time (``evaluate.py``) is below greedy's, so the plan is never worse than greedy's. It returns the
same ``Propagation`` the partitioner consumes. See docs/planner.md.
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch.fx import Node

from compiler.plan.candidates import candidates
from compiler.plan.costmodel import CostModel
from compiler.plan.evaluate import ModeledTime, again, modeled_time
from compiler.plan.solve import Problem, State
from compiler.propagate import _Propagator
from compiler.propagate_state import CONSTRAIN, OpPlan, Propagation
from compiler.sharding import Sharding
from shardspec.mesh import Mesh

__all__ = ["CostModel", "ModeledTime", "modeled_time", "plan_globally"]


def plan_globally(
    graph: torch.fx.Graph,
    greedy: Propagation,
    inputs: list[Sharding],
    outputs: list[Sharding],
    mesh: Mesh,
    model: CostModel,
    unsupported: str = "error",
    cap: int = 24,
    time_limit_s: float = 10.0,
    regather: bool = True,
) -> Propagation:
    """The plan of least modeled time among the candidates, or ``greedy`` when none beats it."""
    if mesh.size == 1:
        return greedy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # greedy already warned about replicated fallbacks
        looker = _Propagator(graph, inputs, outputs, mesh, unsupported)
        looker.sweep_wants()
        problem = Problem(mesh, model)
        states: dict[Node, list[State]] = {}
        options: dict[Node, list[OpPlan]] = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for n, s in zip(placeholders, inputs, strict=True):
            states[n] = [(s, None)]
        for node in graph.nodes:
            if node.op == "get_attr":
                states[node] = [(greedy.value[node], None)]
            elif node.op == "call_function" and node.target is operator.getitem:
                src, idx = node.args
                assert isinstance(src, Node) and isinstance(idx, int)
                xs = problem.choice[src]
                states[node] = [(p.outputs[idx], x) for p, x in zip(options[src], xs, strict=True)]
            elif node.op == "call_function":
                g = greedy.plans[node]
                if node.target is CONSTRAIN:
                    plans = [g]
                else:
                    rule, operands = looker.rule(node)
                    st = [[s for s, _ in states[o]] for o in operands]
                    plans = candidates(node, rule, operands, st, looker.want.get(node), g, mesh, cap)
                options[node] = plans
                xs = problem.add_op(node, plans)
                for p, x in zip(plans, xs, strict=True):
                    for o, r in zip(p.operands, p.required, strict=True):
                        problem.demand(o, states[o], r, x, again(o, node, regather))
                if len(g.outputs) == 1:
                    states[node] = [(p.outputs[0], x) for p, x in zip(plans, xs, strict=True)]
            elif node.op == "output":
                for v, s in zip(node.args[0], outputs, strict=True):
                    if isinstance(v, Node):
                        problem.demand(v, states[v], s, None)
    try:
        chosen = problem.solve(time_limit_s)
    except Exception:  # a solver failure keeps the greedy plan
        chosen = None
    if chosen is None:
        return greedy
    result = Propagation(outputs=list(greedy.outputs), notes=list(greedy.notes))
    result.value.update({n: v for n, v in greedy.value.items() if n.op in ("placeholder", "get_attr")})
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            src, idx = node.args
            result.value[node] = result.plans[src].outputs[idx]
            continue
        p = options[node][chosen[node]]
        result.plans[node] = p
        result.value[node] = p.outputs[0] if len(p.outputs) == 1 else p.outputs  # type: ignore[assignment]
    before = modeled_time(graph, greedy, mesh, model, regather).total_s
    after = modeled_time(graph, result, mesh, model, regather).total_s
    if not after < before * (1 - 1e-9):
        return greedy
    result.notes.append(
        f"global plan: modeled step {after * 1e3:.4g} ms against greedy propagation's {before * 1e3:.4g} ms"
    )
    return result
