"""Pending sums (Partial values): which operands may stay pending through an op, and when a value
must be reduced at its first consumer so that every consumer reuses one reduction."""

from __future__ import annotations

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
        reduced = {o for (o, r) in self.memo if not r.partial}  # already reduced: reuse that
        ok = [
            i
            for i in partial
            if not used & set(current[i].partial)
            and operands[i] not in reduced
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

    def must_reduce_now(self, value: Node, consumer: Node) -> bool:
        """True when another consumer of ``value`` cannot take it Partial: reduce once, here."""
        for user in value.users:
            if user is consumer:
                continue
            if user.op == "output" or user.target is CONSTRAIN:
                return True
            try:
                rule, operands = self.rule(user)
            except ShardingError:
                return True
            if rule.linear == "none" or operands.count(value) > 1:
                return True
            if rule.linear == "first" and operands[0] is not value:
                return True
            if rule.linear == "last" and operands[-1] is not value:
                return True
            others = [o for o in operands if o is not value]
            if rule.linear in ("one", "first", "last") and any(o in self.partial_hint for o in others):
                return True
            if rule.linear == "all" and not all(o in self.partial_hint for o in others):
                return True
        return False
