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
from dataclasses import dataclass, field, replace

import torch
from torch.fx import Node

from compiler.plan.auto import AUTO, held_bytes, layouts
from compiler.plan.candidates import candidates, follow
from compiler.plan.costmodel import CostModel
from compiler.plan.evaluate import ModeledTime, again, modeled_time
from compiler.plan.solve import Problem, State
from compiler.propagate import _Propagator
from compiler.propagate_state import CONSTRAIN, OpPlan, Propagation, shape
from compiler.sharding import Sharding
from shardspec.errors import fail
from shardspec.mesh import Mesh

__all__ = ["AUTO", "CostModel", "Free", "ModeledTime", "modeled_time", "plan_globally"]


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
    free: Free | None = None,
) -> Propagation:
    """The plan of least modeled time among the candidates, or ``greedy`` when none beats it.

    ``free``: AUTO inputs and results (placeholder / result positions with their paths), whose
    layouts the planner chooses too, under ``model.memory_bytes``."""
    free = free or Free()
    limit = float("inf") if model.memory_bytes is None else model.memory_bytes
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if mesh.size == 1:  # one layout for everything: nothing to choose, but the limit still holds
        if _held(placeholders, greedy, mesh) > limit:
            raise _over_limit(model, _held(placeholders, greedy, mesh))
        return greedy
    if free.inputs or free.outputs:  # warm start: the best plan with AUTO leaves replicated
        unbounded = replace(model, memory_bytes=None)  # the limit binds the AUTO choice below
        greedy = plan_globally(
            graph, greedy, inputs, outputs, mesh, unbounded, unsupported, cap, time_limit_s, regather
        )
    choices = {
        placeholders[i]: layouts(shape(placeholders[i]), mesh, exclude=free.fixed_axes) for i in free.inputs
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # greedy already warned about replicated fallbacks
        problem, options = _build(
            graph, greedy, inputs, outputs, mesh, model, unsupported, cap, regather, free, choices
        )
    memory_row(problem, placeholders, inputs, choices, mesh, model)
    try:
        chosen = problem.solve(time_limit_s)
    except Exception:  # a solver failure keeps the greedy plan
        chosen = None
    fits = _held(placeholders, greedy, mesh) <= limit
    if chosen is None:
        if not fits:
            raise _over_limit(model, _held(placeholders, greedy, mesh))
        return _kept(greedy, placeholders, free, mesh)
    result = _assemble(graph, greedy, outputs, options, choices, chosen, free)
    before = modeled_time(graph, greedy, mesh, model, regather).total_s if fits else float("inf")
    after = modeled_time(graph, result, mesh, model, regather).total_s
    smaller = _held(placeholders, result, mesh) < _held(placeholders, greedy, mesh)
    if not (after < before * (1 - 1e-9) or (free.inputs and smaller and after <= before * (1 + 1e-9))):
        return _kept(greedy, placeholders, free, mesh)  # (a tie goes to the plan holding less)
    result.notes.append(
        f"global plan: modeled step {after * 1e3:.4g} ms against greedy propagation's {before * 1e3:.4g} ms"
    )
    for i in free.inputs[:8]:  # each AUTO leaf against its next best layout (one more solve each)
        n = placeholders[i]
        picked = chosen[n]
        problem.rows.append(({problem.choice[n][picked]: 1.0}, 0.0, 0.0))
        other = problem.solve(min(time_limit_s, 2.0))  # for explain() only: a short solve
        problem.rows.pop()
        s = result.value[n]
        assert isinstance(s, Sharding)
        text = (
            f"AUTO {free.in_paths.get(i, n.name)}: chose {s} (modeled step {after * 1e3:.4g} ms, "
            f"{held_bytes(shape(n), _itemsize(n), s, mesh)} bytes per device)"
        )
        if other is not None:
            alt = _assemble(graph, greedy, outputs, options, choices, other, free)
            t = modeled_time(graph, alt, mesh, model, regather).total_s
            a = alt.value[n]
            assert isinstance(a, Sharding)
            text += f"; next best {a}: {t * 1e3:.4g} ms, {held_bytes(shape(n), _itemsize(n), a, mesh)} bytes"
        result.notes.append(text)
    return result


def _kept(greedy: Propagation, placeholders: list[Node], free: Free, mesh: Mesh) -> Propagation:
    """The greedy plan, with a note for each AUTO input saying it stayed as greedy placed it."""
    for i in free.inputs[:8]:
        n = placeholders[i]
        s = greedy.value[n]
        assert isinstance(s, Sharding)
        greedy.notes.append(
            f"AUTO {free.in_paths.get(i, n.name)}: chose {s} (no plan was modeled faster than greedy "
            f"propagation's with it; {held_bytes(shape(n), _itemsize(n), s, mesh)} bytes per device)"
        )
    return greedy


def _over_limit(model: CostModel, held: int) -> Exception:
    return fail(
        f"no plan found that holds the step's inputs within memory_bytes={model.memory_bytes} per "
        f"device (the inputs as laid out, AUTO ones replicated, hold {held}).",
        "raise CostModel(memory_bytes=...), add devices, or split more inputs by hand.",
    )


@dataclass(frozen=True)
class Free:
    """Positions of AUTO inputs (placeholders) and results, with their paths for explain(), and
    the axes no AUTO layout may split over (a pipeline's axis)."""

    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    in_paths: dict[int, str] = field(default_factory=dict)
    fixed_axes: frozenset[str] = frozenset()


def _itemsize(n: Node) -> int:
    return int(n.meta["val"].element_size())


def _held(placeholders: list[Node], prop: Propagation, mesh: Mesh) -> int:
    total = 0
    for n in placeholders:
        s = prop.value[n]
        assert isinstance(s, Sharding)
        total += held_bytes(shape(n), _itemsize(n), s, mesh)
    return total


def memory_row(
    problem: Problem,
    placeholders: list[Node],
    inputs: list[Sharding],
    choices: dict[Node, list[Sharding]],
    mesh: Mesh,
    model: CostModel,
) -> None:
    """The memory limit: the inputs each device holds (fixed ones as they are, AUTO ones as chosen)."""
    if model.memory_bytes is None:
        return
    fixed = sum(
        held_bytes(shape(n), _itemsize(n), s, mesh)
        for n, s in zip(placeholders, inputs, strict=True)
        if n not in choices
    )
    row = {
        x: float(held_bytes(shape(n), _itemsize(n), s, mesh))
        for n, opts in choices.items()
        for s, x in zip(opts, problem.choice[n], strict=True)
    }
    problem.rows.append((row, -float("inf"), float(model.memory_bytes - fixed)))


def _build(
    graph: torch.fx.Graph,
    greedy: Propagation,
    inputs: list[Sharding],
    outputs: list[Sharding],
    mesh: Mesh,
    model: CostModel,
    unsupported: str,
    cap: int,
    regather: bool,
    free: Free,
    choices: dict[Node, list[Sharding]],
    merge: bool = True,
) -> tuple[Problem, dict[Node, list[OpPlan]]]:
    looker = _Propagator(graph, inputs, outputs, mesh, unsupported)
    looker.sweep_wants()
    problem = Problem(mesh, model)
    states: dict[Node, list[State]] = {}
    options: dict[Node, list[OpPlan]] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    xs: list[int | None]
    for n, s in zip(placeholders, inputs, strict=True):
        if n in choices:
            picks = problem.add_choice(n, [held_bytes(shape(n), _itemsize(n), c, mesh) for c in choices[n]])
            states[n] = list(zip(choices[n], picks, strict=True))
        else:
            states[n] = [(s, None)]
    for node in graph.nodes:
        if node.op == "get_attr":
            states[node] = [(greedy.value[node], None)]
        elif node.op == "call_function" and node.target is operator.getitem:
            src, idx = node.args
            assert isinstance(src, Node) and isinstance(idx, int)
            xs = list(problem.choice[src])
            states[node] = [(p.outputs[idx], x) for p, x in zip(options[src], xs, strict=True)]
        elif node.op == "call_function":
            g = greedy.plans[node]
            merged = None
            if node.target is CONSTRAIN:
                plans = [g]
            else:
                rule, operands = looker.rule(node)
                st = [[s for s, _ in states[o]] for o in operands]
                merged = follow(node, rule, operands, st, mesh) if merge else None
                plans = merged or candidates(node, rule, operands, st, looker.want.get(node), g, mesh, cap)
            options[node] = plans
            if merged is not None:  # no variables: the producer's state picks the plan
                xs = problem.add_follow(node, plans, [x for _, x in states[operands[0]]])
            else:
                xs = list(problem.add_op(node, plans))
                for p, x in zip(plans, xs, strict=True):
                    for o, r in zip(p.operands, p.required, strict=True):
                        problem.demand(o, states[o], r, x, again(o, node, regather), node)
            if len(g.outputs) == 1:
                states[node] = [(p.outputs[0], x) for p, x in zip(plans, xs, strict=True)]
        elif node.op == "output":
            for k, (v, s) in enumerate(zip(node.args[0], outputs, strict=True)):
                if not isinstance(v, Node):
                    continue
                if k in free.outputs:  # an AUTO result leaves as computed, its pending sums reduced
                    for held, sel in states[v]:
                        if held.partial:
                            problem.demand(v, [(held, sel)], held.without_partial(), None)
                else:
                    problem.demand(v, states[v], s, None)
    return problem, options


def _assemble(
    graph: torch.fx.Graph,
    greedy: Propagation,
    outputs: list[Sharding],
    options: dict[Node, list[OpPlan]],
    choices: dict[Node, list[Sharding]],
    chosen: dict[Node, int],
    free: Free,
) -> Propagation:
    result = Propagation(outputs=list(outputs), notes=list(greedy.notes))
    for n, v in greedy.value.items():
        if n.op in ("placeholder", "get_attr"):
            result.value[n] = choices[n][chosen[n]] if n in choices else v
    for node in graph.nodes:
        if node.op == "output":
            for k in free.outputs:
                v = node.args[0][k]
                if isinstance(v, Node):
                    s = result.value[v]
                    assert isinstance(s, Sharding)
                    result.outputs[k] = s.without_partial()
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            src, idx = node.args
            assert isinstance(src, Node) and isinstance(idx, int)
            result.value[node] = result.plans[src].outputs[idx]
            continue
        p = options[node][chosen[node]]
        result.plans[node] = p
        result.value[node] = p.outputs[0] if len(p.outputs) == 1 else p.outputs  # type: ignore[assignment]
    return result
