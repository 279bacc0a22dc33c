"""The whole-graph choice as an integer program (the formulation of Alpa's intra-op pass).

Variables: ``x[v, j]`` = op ``v`` runs candidate ``j`` (exactly one per op), and ``z[u, i, t]`` =
value ``u``, left in state ``i`` by its producer's candidate, is resharded to target ``t`` (priced
once however many consumers read that target: the partitioner memoizes (value, target)). For each
consumer candidate needing ``u`` as ``t``: ``z[u, i, t] >= x[u, i] + x[v, j] - 1``; a pair no
reshard can join (a consumer wanting a pending sum the producer does not leave) is excluded by
``x[u, i] + x[v, j] <= 1``. Objective: reshard seconds + compute seconds, plus a tiny bonus on the
greedy choice so equal plans resolve to it deterministically. Solved by HiGHS through
``scipy.optimize.milp`` under a time limit; no answer means the caller keeps the greedy plan.
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

    def add_choice(self, node: Node, count: int) -> list[int]:
        """``count`` layouts of an AUTO input, one to be chosen (free in itself)."""
        xs = [self.var(0.0) for _ in range(count)]
        self.rows.append((dict.fromkeys(xs, 1.0), 1.0, 1.0))
        self.choice[node] = xs
        return xs

    def demand(
        self, value: Node, states: list[State], target: Sharding, consumer: int | None, again: bool = False
    ) -> None:
        """Consumer variable ``consumer`` (None: always) needs ``value`` as ``target``; ``again``:
        a backward read of an input, which the regather pass gathers a second time."""
        for i, (s, x) in enumerate(states):
            if s == target:
                continue
            key = (value, i, target)
            if key not in self.time:
                try:
                    self.time[key] = reshard_s(value, s, target, self.mesh, self.model)
                except AssertionError:
                    self.time[key] = -1.0  # no reshard reaches it
            if self.time[key] < 0:
                row = {k: 1.0 for k in (x, consumer) if k is not None}
                if not row:
                    raise ValueError("a fixed value cannot reach a fixed target")
                self.rows.append((row, -np.inf, len(row) - 1.0))
                continue
            if (*key, again) not in self.z:
                self.z[(*key, again)] = self.var(self.time[key])
            zi = self.z[(*key, again)]
            row = {zi: 1.0}
            for k in (x, consumer):
                if k is not None:
                    row[k] = row.get(k, 0.0) - 1.0
            self.rows.append((row, -(sum(1 for k in (x, consumer) if k is not None) - 1.0), np.inf))

    def solve(self, time_limit_s: float) -> dict[Node, int] | None:
        """Each op's chosen candidate index, or None when HiGHS finds no answer in time."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        n = len(self.cost)
        r, c, v = [], [], []
        lo, hi = [], []
        for k, (row, a, b) in enumerate(self.rows):
            for col, val in row.items():
                r.append(k)
                c.append(col)
                v.append(val)
            lo.append(a)
            hi.append(b)
        a_mat = coo_matrix((v, (r, c)), shape=(len(self.rows), n)).tocsr()
        scale = max(max(abs(x) for x in self.cost), 1e-30)  # seconds are tiny: solve in units of the largest
        res = milp(
            np.asarray(self.cost) / scale,
            constraints=LinearConstraint(a_mat, np.asarray(lo), np.asarray(hi)),
            integrality=np.ones(n),
            bounds=Bounds(np.zeros(n), np.ones(n)),
            options={"time_limit": time_limit_s, "disp": False},
        )
        if res.x is None:
            return None
        return {node: int(np.argmax([res.x[x] for x in xs])) for node, xs in self.choice.items()}
