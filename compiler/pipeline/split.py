"""The pipeline pass: one rank's program -> the program of its pipeline stage(s).

The rank at position ``q`` along the pipeline axis keeps the nodes of its stages, in the order of its
schedule's action list: each action's block of nodes (the forward, backward or weight-gradient part
of one microbatch on one stage) runs in graph order; nodes outside microbatches (the batch split,
the accumulation, the optimizer) run as soon as their inputs are there, so the data-parallel
gradient reduction runs once, after the last microbatch. A value read on another position is sent
right after its block and received before its first reader (``check.with_p2p``), and the result is
checked symbolically (``check.check``) before anything runs. Pure: the input program is not changed.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from compiler.passes.graph import LAUNCHES
from compiler.pipeline.boundary import BOUNDARY
from compiler.pipeline.check import Op, Transfer, check, with_p2p
from compiler.pipeline.schedules import Action, Lists
from compiler.pipeline.stages import Label, StagePlan
from compiler.pipeline.timeline import mark
from shardspec.errors import ShardingError, fail

SEND = torch.ops.shardspec.send.default
RECV = torch.ops.shardspec.recv.default


@dataclass(frozen=True)
class P2P:
    """One value sent between pipeline positions in a step."""

    value: str
    src: int
    dst: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    producer: str
    consumer: str
    origin: str = ""  # the global graph's node of the value (reports name its user line)


@dataclass(frozen=True)
class StageProgram:
    module: GraphModule
    ops: tuple[tuple[Op, ...], ...]  # every position's op list (compute keys, sends, recvs)
    p2p: tuple[P2P, ...]  # sends of every position
    outputs: tuple[int, ...]  # per result: the pipeline position that returns it
    reads: frozenset[int]  # the tensor inputs this position's program reads


def key_str(key: Hashable) -> str:
    if isinstance(key, Action):
        return str(key)
    assert isinstance(key, tuple)
    return f"T:{key[1]}"


def _labels(gm: GraphModule, plan: StagePlan) -> dict[Node, Label]:
    """Per-rank nodes -> labels: partitioned nodes by their traced origin, getitems by their source,
    inserted collectives (and the rest) by their first labelled user."""
    nodes = list(gm.graph.nodes)
    out: dict[Node, Label] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        origin = n.meta.get("shardspec_origin")
        if origin in plan.labels:
            out[n] = plan.labels[origin]
        elif n.target is operator.getitem and n.args[0] in out:
            out[n] = out[n.args[0]]
    for n in reversed(nodes):
        if n.op == "call_function" and n not in out:
            users = [out[u] for u in n.users if u in out]
            if users:
                out[n] = users[0]
    for n in nodes:
        if n.op == "call_function" and n not in out:
            ins = [out[a] for a in n.all_input_nodes if a in out]
            out[n] = ins[0] if ins else Label(0, -1, "T")
    return out


def _value_name(item: Hashable) -> str:
    assert isinstance(item, tuple)
    return str(item[0])


def _key(n: Node, lab: Label, weight: set[Node]) -> Hashable:
    if lab.kind == "T":
        return ("T", n.name)
    kind = "W" if n in weight else lab.kind
    return Action(kind, lab.stage, lab.mb)


def _weight_nodes(gm: GraphModule, labels: dict[Node, Label], p: int) -> set[Node]:
    """Backward nodes that compute no gradient another position reads: ZB-H1's W part."""
    feeds: set[Node] = set()
    nodes = list(gm.graph.nodes)
    for n in reversed(nodes):
        lab = labels.get(n)
        if lab is None or lab.kind != "B":
            continue
        crosses = any(u in labels and labels[u].stage % p != lab.stage % p for u in n.users)
        inner = any(u in feeds and labels[u].stage == lab.stage and labels[u].mb == lab.mb for u in n.users)
        if crosses or inner:
            feeds.add(n)
    return {n for n, lab in labels.items() if lab.kind == "B" and n not in feeds}


def _run_at_first_use(
    nodes: Sequence[Node],
    keys: dict[Node, Hashable],
    where: dict[Node, int],
    lists: Lists,
    plan: StagePlan,
) -> None:
    """An inserted node (a collective, a reshape) runs in the action of its first user in its
    position's schedule, not of its first user in the graph: a weight gathered for one
    microbatch's backward and reused by the next one's forward (a convolution's weight, split over
    tp, needed whole by its backward) would otherwise make that forward wait for the backward,
    which 1F1B runs later. Users come after the node in the graph, so its inputs are there."""
    index = [{a: i for i, a in enumerate(acts)} for acts in lists]
    for n in reversed(nodes):
        inserted = n.meta.get("shardspec_origin") not in plan.labels and n.target is not operator.getitem
        if n not in keys or not inserted or not isinstance(keys[n], Action):
            continue
        q = where[n]
        own = keys[n]
        firsts = [
            k
            for u in n.users
            if u in keys and where.get(u) == q and isinstance(k := keys[u], Action) and k in index[q]
        ]
        if firsts and own in index[q]:
            keys[n] = min([own, *firsts], key=lambda a: index[q][a])


def _replicated(
    nodes: Sequence[Node], where: dict[Node, int], labels: dict[Node, Label], p: int
) -> dict[Node, frozenset[int]]:
    """Nodes outside microbatches computed from inputs and constants alone (the batch split into
    microbatches, a step counter) that other positions read: each position computes its own copy
    instead of receiving it. Maps them to the positions that need them."""
    pure: set[Node] = set()
    for n in nodes:
        if (
            n in where
            and labels[n].kind == "T"
            and all(a.op in ("placeholder", "get_attr") or a in pure for a in n.all_input_nodes)
        ):
            pure.add(n)
    need: dict[Node, set[int]] = {}
    for n in reversed(nodes):
        if n in pure:
            need[n] = {q for u in n.users if u in where for q in (need.get(u) or {where[u]})}
            if any(u.op == "output" for u in n.users):  # a result (a step counter): every position
                need[n] |= set(range(p))  # holds it, for whichever reads it in the next step
    return {n: frozenset(qs) for n, qs in need.items() if qs - {where[n]}}


def _order(
    nodes: Sequence[Node],
    keys: dict[Node, Hashable],
    where: dict[Node, int],
    copies: dict[Node, frozenset[int]],
    actions: Sequence[Action],
    q: int,
) -> list[Hashable]:
    """Position ``q``'s compute keys: its actions in schedule order, each free node (``T``) as soon
    as its inputs on this position are computed, free nodes reading other positions at the end."""
    mine = [n for n in nodes if n in keys and (q in copies[n] if n in copies else where[n] == q)]
    free = [n for n in mine if isinstance(keys[n], tuple)]
    order: list[Hashable] = []
    placed: set[Node] = set()
    by_key: dict[Hashable, list[Node]] = {}
    for n in mine:
        by_key.setdefault(keys[n], []).append(n)

    def flush() -> None:
        changed = True
        while changed:
            changed = False
            for n in free:
                if n not in placed and all(a not in keys or a in placed for a in n.all_input_nodes):
                    placed.add(n)
                    order.append(keys[n])
                    changed = True

    for a in actions:
        flush()
        order.append(a)
        placed.update(by_key.get(a, ()))
    flush()
    order += [keys[n] for n in free if n not in placed]
    return order


def split_program(
    gm: GraphModule, plan: StagePlan, lists: Lists, q: int, axis: str, mesh_key: str, record: bool = True
) -> StageProgram:
    """Position ``q``'s stage program of the per-rank program ``gm`` (annotated with ``meta['val']``)."""
    p = len(lists)
    labels = _labels(gm, plan)
    split_w = any(a.kind == "W" for acts in lists for a in acts)
    weight = _weight_nodes(gm, labels, p) if split_w else set()
    keys = {n: _key(n, lab, weight) for n, lab in labels.items()}
    nodes = list(gm.graph.nodes)
    where = {n: lab.stage % p for n, lab in labels.items()}
    _run_at_first_use(nodes, keys, where, lists, plan)
    copies = _replicated(nodes, where, labels, p)
    for n in copies:
        keys[n] = ("T", n.name)
    orders = [_order(nodes, keys, where, copies, lists[r], r) for r in range(p)]
    index = [{k: i for i, k in enumerate(o)} for o in orders]
    moves: list[Transfer] = []
    for u in nodes:
        if u not in keys or u in copies:
            continue
        dsts: dict[int, list[Hashable]] = {}
        for v in u.users:
            if v in keys and where[v] != where[u]:
                dsts.setdefault(where[v], []).append(keys[v])
        for dst, consumers in sorted(dsts.items()):
            first = min(consumers, key=lambda k: index[dst][k])
            moves.append(Transfer((u.name, dst), keys[u], first, where[u], dst))
    ops = with_p2p(orders, moves)
    made = {t.item: t.producer for t in moves}
    needs_of: dict[Hashable, list[Hashable]] = {}
    for n in nodes:
        for a in n.all_input_nodes if n in keys else ():
            if a in keys and keys[a] != keys[n]:
                need = keys[a] if where[a] == where[n] or a in copies else (a.name, where[n])
                needs_of.setdefault(keys[n], []).append(need)
    try:
        check(ops, lambda k: needs_of.get(k, []), made)
    except ShardingError as exc:
        raise fail(
            "a value used across pipeline stages cannot be sent in this schedule: "
            f"{str(exc).split(chr(10) + 'Fix:')[0]}",
            "pass values between stages only through pipeline_boundary, from earlier stages to later "
            "ones in the forward (no value of a later stage read by an earlier one).",
        ) from None
    return _emit(gm, nodes, keys, where, copies, ops, q, axis, mesh_key, moves, record)


def _emit(
    gm: GraphModule,
    nodes: list[Node],
    keys: dict[Node, Hashable],
    where: dict[Node, int],
    copies: dict[Node, frozenset[int]],
    ops: tuple[tuple[Op, ...], ...],
    q: int,
    axis: str,
    mesh_key: str,
    moves: list[Transfer],
    record: bool,
) -> StageProgram:
    graph = Graph()
    env: dict[Node, Any] = {}
    root = torch.nn.Module()
    by_name = {n.name: n for n in nodes}
    by_key: dict[Hashable, list[Node]] = {}
    for n in nodes:
        if n in keys and (q in copies[n] if n in copies else where[n] == q):
            by_key.setdefault(keys[n], []).append(n)
    reads: set[int] = set()
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = graph.placeholder(n.name)
    for n in nodes:
        if n.op == "get_attr":
            setattr(root, str(n.target), getattr(gm, str(n.target)))
            env[n] = graph.get_attr(str(n.target))

    def mapped(a: Any) -> Any:
        if isinstance(a, Node):
            if a.op == "placeholder":
                reads.add(placeholders.index(a))
            return env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(mapped(x) for x in a)
        if isinstance(a, dict):
            return {k: mapped(v) for k, v in a.items()}
        return a

    for op in ops[q]:
        if op.kind == "recv":
            name = _value_name(op.what)
            v = by_name[name].meta["val"]
            env[by_name[name]] = graph.call_function(
                RECV,
                (),
                {
                    "shape": list(v.shape),
                    "dtype": v.dtype,
                    "device": v.device,
                    "axis": axis,
                    "src": op.peer,
                    "mesh": mesh_key,
                },
            )
        elif op.kind == "send":
            name = _value_name(op.what)
            graph.call_function(SEND, (env[by_name[name]],), {"axis": axis, "dst": op.peer, "mesh": mesh_key})
        else:
            block = by_key.get(op.what, [])
            label = key_str(op.what)
            if record and isinstance(op.what, Action):
                graph.call_function(mark, (label, "start"))
            for n in block:
                if n.target is BOUNDARY:
                    env[n] = mapped(n.args[0])  # an identity: the value (received or local) itself
                    continue
                env[n] = graph.call_function(n.target, mapped(n.args), mapped(n.kwargs))  # type: ignore[arg-type]
                env[n].meta.update({k: v for k, v in n.meta.items() if k != "val"})
                if n.target in LAUNCHES:  # reports find the collective's record by its old name
                    env[n].meta.setdefault("shardspec_members", [n.name])
            if record and isinstance(op.what, Action):
                graph.call_function(mark, (label, "end"))
    out_node = nodes[-1]
    results = []
    owners = []
    for v in out_node.args[0]:  # type: ignore[union-attr]
        if isinstance(v, Node) and v.op == "placeholder":
            owners.append(q)  # every position holds its inputs
            results.append(mapped(v))
        elif isinstance(v, Node) and v in copies:  # computed on several positions: each returns it
            owners.append(q if q in copies[v] else min(copies[v]))
            results.append(env[v] if q in copies[v] else None)
        elif isinstance(v, Node) and v in keys:
            owners.append(where[v])
            results.append(env[v] if where[v] == q else None)
        else:
            owners.append(q)
            results.append(mapped(v))
    graph.output(tuple(results))
    module = GraphModule(root, graph)
    p2p = tuple(
        P2P(
            t.item[0],  # type: ignore[index]
            t.src,
            t.dst,
            tuple(by_name[t.item[0]].meta["val"].shape),  # type: ignore[index]
            by_name[t.item[0]].meta["val"].dtype,  # type: ignore[index]
            by_name[t.item[0]].meta["val"].numel() * by_name[t.item[0]].meta["val"].element_size(),  # type: ignore[index]
            key_str(t.producer),
            key_str(t.consumer),
            str(by_name[t.item[0]].meta.get("shardspec_origin", "")),  # type: ignore[index]
        )
        for t in moves
    )
    return StageProgram(module, ops, p2p, tuple(owners), frozenset(reads))
