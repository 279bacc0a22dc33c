"""Pending sums (Partial values): which operands may stay pending through an op, and when a value
must be reduced at its first consumer so that every consumer reuses one reduction.

Reassociation: a sum may stay pending through linear ops and be reduced later, where it is smaller
(a weight gradient summed over the batch). But a value read by several consumers that would each
carry it pending is reduced once per consumer later on; when those later reductions together hold
at least as many elements as the value itself, reducing it once, now, sends no more. Layer norm's
backward is the textbook case: its incoming gradient feeds the input's gradient (as large as the
gradient), ``grad * x_hat`` and ``grad`` summed for the weight and bias: one reduction of the
gradient instead of three (and the parameters' gradients then pending over the batch axes only)."""

from __future__ import annotations

import operator

from torch.fx import Node

from compiler.propagate_state import CONSTRAIN, PropagatorBase, _numel
from compiler.rules.notation import Rule
from compiler.sharding import Axes, Sharding
from shardspec.errors import ShardingError


class PendingSums(PropagatorBase):
    def kept_partials(
        self, node: Node, rule: Rule, operands: list[Node], current: list[Sharding], used: set[str]
    ) -> dict[int, Axes]:
        """Which operands stay Partial through this op (the rest get reduced first)."""
        partial = [i for i, s in enumerate(current) if s.partial]
        if not partial or rule.linear == "none":
            return {}
        ok = [
            i
            for i in partial
            if not used & set(current[i].partial)
            and not self.reduced_before(operands[i])
            and not self.must_reduce_now(operands[i], node)
        ]
        if rule.linear == "all":
            axes = {current[i].partial for i in range(len(current))}
            if len(ok) == len(current) and len(axes) == 1:
                return {i: current[i].partial for i in ok}
            return {}
        if len(partial) != 1 or len(ok) != 1 or operands.count(operands[ok[0]]) > 1:
            return {}
        if (rule.linear == "first" and ok[0] != 0) or (rule.linear == "last" and ok[0] != len(operands) - 1):
            return {}
        if _numel(node) > _numel(operands[ok[0]]):
            return {}  # the pending sum would grow: reducing the operand now sends fewer bytes
        return {ok[0]: current[ok[0]].partial}

    def reduced_before(self, value: Node) -> bool:
        """Whether an earlier op already reduced ``value`` (reuse that). Read from ``moved`` (the
        layouts memo holds per value), not by scanning memo: that grew with the graph, and scanning
        it for every pending operand made this quadratic in depth."""
        return any(not r.partial for r in self.moved.get(value, ()))

    def must_reduce_now(self, value: Node, consumer: Node) -> bool:
        """True when another consumer of ``value`` cannot take it Partial, or when the consumers
        that would carry it pending would later reduce at least its size between them: reduce
        once, here."""
        key = (value, consumer)
        if key not in self.reduce_now:
            users = [u for u in value.users if u.op == "call_function"]
            self.reduce_now[key] = any(
                user is not consumer and not self.takes_pending(user, value) for user in value.users
            ) or (len(users) > 1 and sum(self.reduced_size(u) for u in users) >= _numel(value))
        return self.reduce_now[key]

    def takes_pending(self, user: Node, value: Node) -> bool:
        """Whether ``user`` can take ``value`` as a pending sum (by its rule's linearity)."""
        if user.op == "output" or user.target is CONSTRAIN:
            return False
        if user.target is operator.getitem:
            return True
        try:
            rule, operands = self.rule(user)
        except ShardingError:
            return False
        if value not in operands or rule.linear == "none" or operands.count(value) > 1:
            return False
        if rule.linear == "first" and operands[0] is not value:
            return False
        if rule.linear == "last" and operands[-1] is not value:
            return False
        others = [o for o in operands if o is not value]
        if rule.linear in ("one", "first", "last") and any(o in self.partial_hint for o in others):
            return False
        return not (rule.linear == "all" and not all(o in self.partial_hint for o in others))

    def reduced_size(self, user: Node, depth: int = 0) -> int:
        """Elements a pending sum carried into ``user`` is reduced at, later: the smallest value
        along the chain of single consumers that still take it pending (a few steps on)."""
        size = _numel(user)
        outs = [u for u in user.users if u.op == "call_function"]
        if isinstance(user.meta.get("val"), (tuple, list)):  # a multi-result op: its results
            return sum(self.reduced_size(g, depth) for g in outs)
        if depth < 6 and len(user.users) == 1 and outs and self.takes_pending(outs[0], user):
            return min(size, self.reduced_size(outs[0], depth + 1))
        return size
