"""The whole-graph choice as an integer program (the formulation of Alpa's intra-op pass).

Variables: ``x[v, j]`` = op ``v`` runs candidate ``j`` (exactly one per op), and ``z[u, i, t]`` =
value ``u``, left in state ``i`` by its producer's candidate, is resharded to target ``t`` (priced
once however many consumers read that target: the partitioner memoizes (value, target)). For each
consumer ``v`` and the set ``J`` of its candidates needing ``u`` as ``t``:
``z[u, i, t] >= x[u, i] + sum_J x[v, j] - 1`` (one row for the set: valid since ``v`` runs one
candidate, and a tighter relaxation than a row per candidate); a pair no reshard can join (a consumer
wanting a pending sum the producer does not leave) is excluded by ``x[u, i] + sum_J x[v, j] <= 1``.
An op merged into its producer (``follows``: a view or unary op that keeps its operand's layout) has
no variables of its own: it runs the plan matching its operand's state. Objective: reshard seconds
+ compute seconds, plus a tiny bonus on the greedy choice so equal plans resolve to it
deterministically. Solved by HiGHS through
``scipy.optimize.milp`` under a node limit (deterministic: every rank stops at the same plan) and a
time limit (a guard: when it binds, or no answer is found, the caller keeps the greedy plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch.fx import Node

from compiler.plan.costmodel import CostModel
from compiler.plan.evaluate import flops_of, reshard_s
from compiler.propagate_state import OpPlan
from compiler.sharding import Sharding
from shardspec.mesh import Mesh

# branch-and-bound nodes HiGHS may explore: a limit by work, not time, so every rank (each compiles
# its own program) stops at the same plan; the time limit is only a guard, and greedy's plan wins
# when it binds
NODE_LIMIT = 20_000

# a state of a value: the sharding and the variable that selects it (None: always, an input)
State = tuple[Sharding, int | None]


@dataclass
class Problem:
    mesh: Mesh
    model: CostModel
    cost: list[float] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    choice: dict[Node, list[int]] = field(default_factory=dict)  # op -> its x variables
    z: dict[tuple[Node, int, Sharding, bool], int] = field(default_factory=dict)
    # (value, state, target, again, reader) -> (the state's variable, the reader's candidates)
    links: dict[tuple[Node, int, Sharding, bool, Node | None], tuple[int | None, list[int | None]]] = field(
        default_factory=dict
    )
    follows: dict[Node, list[int | None]] = field(default_factory=dict)  # merged op -> its producer's
    _linked: list[tuple[dict[int, float], float, float]] | None = None
    time: dict[tuple[Node, int, Sharding], float] = field(default_factory=dict)

    def var(self, cost: float) -> int:
        self.cost.append(cost)
        return len(self.cost) - 1

    def add_op(self, node: Node, plans: list[OpPlan]) -> list[int]:
        scale = 1e-9 * self.model.latency_s  # tie-break toward greedy (plans[0]): far below any real cost
        xs = [
            self.var(self.model.compute_s(flops_of(node, p, self.mesh)) - (scale if j == 0 else 0.0))
            for j, p in enumerate(plans)
        ]
        self.rows.append((dict.fromkeys(xs, 1.0), 1.0, 1.0))
        self.choice[node] = xs
        return xs

    def add_follow(self, node: Node, plans: list[OpPlan], producer: list[int | None]) -> list[int | None]:
        """A merged op: plan ``i`` runs when its operand is in state ``i`` (that state's variable);
        its compute seconds are charged to that variable."""
        for p, y in zip(plans, producer, strict=True):
            if y is not None:
                self.cost[y] += self.model.compute_s(flops_of(node, p, self.mesh))
        self.follows[node] = producer
        return producer

    def add_choice(self, node: Node, held: list[int]) -> list[int]:
        """The layouts of an AUTO input (the bytes a device holds of each), one to be chosen: free
        in itself but for a tie-break toward holding less, above greedy's (per op) and far below
        any real cost (a byte's transfer)."""
        scale = 1e-6 * self.model.latency_s / max(max(held, default=1), 1)
        xs = [self.var(scale * b) for b in held]
        self.rows.append((dict.fromkeys(xs, 1.0), 1.0, 1.0))
        self.choice[node] = xs
        return xs

    def demand(
        self,
        value: Node,
        states: list[State],
        target: Sharding,
        consumer: int | None,
        again: bool = False,
        reader: Node | None = None,
    ) -> None:
        """Consumer variable ``consumer`` (None: always) of op ``reader`` needs ``value`` as
        ``target``; ``again``: a backward read of an input, which the regather pass gathers a
        second time. The rows are written by ``links_rows``, one per (state, target, reader)."""
        for i, (s, x) in enumerate(states):
            if s == target:
                continue
            key = (value, i, target)
            if key not in self.time:
                try:
                    self.time[key] = reshard_s(value, s, target, self.mesh, self.model)
                except AssertionError:
                    self.time[key] = -1.0  # no reshard reaches it
            link = self.links.setdefault((value, i, target, again, reader), (x, []))
            link[1].append(consumer)

    def links_rows(self) -> list[tuple[dict[int, float], float, float]]:
        """The reshard rows. A reader runs one candidate at most, so its candidates needing the
        same target share one row: ``z >= x[u, i] + sum_j x[v, j] - 1`` (tighter than one row per
        candidate, and fewer); a pair no reshard joins: ``x[u, i] + sum_j x[v, j] <= 1``."""
        rows: list[tuple[dict[int, float], float, float]] = []
        for (value, i, target, again, _), (x, consumers) in self.links.items():
            always = None in consumers
            picks = sorted({c for c in consumers if c is not None}) if not always else []
            sel = ([x] if x is not None else []) + picks
            if self.time[(value, i, target)] < 0:
                if not sel and always:
                    raise ValueError("a fixed value cannot reach a fixed target")
                fixed = (x is None) + always  # terms that are always 1: the row says not all
                rows.append((dict.fromkeys(sel, 1.0), -np.inf, 1.0 - fixed))
                continue
            zkey = (value, i, target, again)
            if zkey not in self.z:
                self.z[zkey] = self.var(self.time[(value, i, target)])
            row = {self.z[zkey]: 1.0}
            for k in sel:
                row[k] = row.get(k, 0.0) - 1.0
            rows.append((row, (x is None) + always - 1.0, np.inf))
        return rows

    def solve(self, time_limit_s: float) -> dict[Node, int] | None:
        """Each op's chosen candidate index, or None when HiGHS finds no answer in time."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        if self._linked is None:
            self._linked = self.links_rows()  # creates the z variables: before counting them
        n = len(self.cost)
        r, c, v = [], [], []
        lo, hi = [], []
        for k, (row, a, b) in enumerate(self.rows + self._linked):
            for col, val in row.items():
                r.append(k)
                c.append(col)
                v.append(val)
            lo.append(a)
            hi.append(b)
        a_mat = coo_matrix((v, (r, c)), shape=(len(lo), n)).tocsr()
        scale = max(max(abs(x) for x in self.cost), 1e-30)  # seconds are tiny: solve in units of the largest
        res = milp(
            np.asarray(self.cost) / scale,
            constraints=LinearConstraint(a_mat, np.asarray(lo), np.asarray(hi)),
            integrality=np.ones(n),
            bounds=Bounds(np.zeros(n), np.ones(n)),
            options={"time_limit": time_limit_s, "node_limit": NODE_LIMIT, "disp": False},
        )
        if res.x is None or "time limit" in str(res.message).lower():
            return None  # where the clock stops depends on load: keep greedy's plan, on every rank
        # a node limit stops at the same point on every rank: its best plan so far is deterministic
        chosen = {node: int(np.argmax([res.x[x] for x in xs])) for node, xs in self.choice.items()}
        for node, ys in self.follows.items():  # a merged op runs the plan of its operand's state
            chosen[node] = int(np.argmax([res.x[y] if y is not None else 1.0 for y in ys]))
        return chosen
