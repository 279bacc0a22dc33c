"""Looking ahead from an op: wants (from out_specs and constraints, swept backward) and, where no
want speaks, hints from the consumers' already-placed operands; which values count as parameters."""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from compiler.propagate_state import _VIEW_LIKE, CONSTRAIN, PropagatorBase, Want, _node, shape
from compiler.sharding import Axes, Sharding
from shardspec.errors import ShardingError

_ADAMW = torch.ops.shardspec.adamw.default


class Lookahead(PropagatorBase):
    def sweep_wants(self) -> None:
        nodes = list(self.graph.nodes)
        out = nodes[-1]
        for v, s in zip(out.args[0], self.out_specs, strict=True):
            if isinstance(v, Node):
                self.want.setdefault(v, s.dims)
        for node in reversed(nodes):
            if node.op != "call_function":
                continue
            if node.target is CONSTRAIN:
                fixed = self.constraint(node).dims
                self.want[node] = fixed
                self.want.setdefault(_node(node.args[0]), fixed)
                continue
            w = self.want.get(node)
            if w is None or node.target is operator.getitem:
                continue
            try:
                rule, operands = self.rule(node)
            except ShardingError:
                continue
            if len(rule.outputs) != 1 or len(rule.outputs[0]) != len(w) or rule.reductions:
                continue  # a contraction's output layout says nothing reliable about its operands
            fw = {
                dim[0]: axes for dim, axes in zip(rule.outputs[0], w, strict=True) if dim and axes is not None
            }
            for op, toks in zip(operands, rule.operands, strict=True):
                if op in self.want or len(toks) != len(shape(op)):
                    continue
                dims = tuple(fw.get(t[0]) if t and t[0] not in rule.minor else None for t in toks)
                flat = [a for d in dims if d for a in d]
                if len(flat) == len(set(flat)) and any(d is not None for d in dims):
                    self.want[op] = dims

    def want_target(self, w: Want | None, outputs: tuple[Sharding, ...]) -> Sharding | None:
        """The output's want (``w``: the node's want or its consumers' hint) merged with the
        candidate where the want has no preference."""
        if w is None or len(outputs) != 1 or len(w) != len(outputs[0].dims):
            return None
        dims = [axes if axes is not None else () for axes in w]
        taken = {a for d in dims for a in d}
        for k, axes in enumerate(w):
            if axes is None and not taken & set(outputs[0].dims[k]):
                dims[k] = outputs[0].dims[k]
                taken |= set(dims[k])
        return Sharding(tuple(dims))

    def param_like(self, node: Node) -> bool:
        """An input, or a view / transpose / cast / copy of one (a weight's ``.t()`` included)."""
        if node.op in ("placeholder", "get_attr"):
            return True
        if node.op != "call_function" or node.target not in _VIEW_LIKE:
            return False
        srcs = [a for a in node.args if isinstance(a, Node)]
        return len(srcs) == 1 and self.param_like(srcs[0])

    def consumer_hint(self, node: Node, depth: int = 0) -> Want | None:
        """A few steps of lookahead: the layout that a consumer's already-placed operands imply for
        this value (the residual stream tells an attention output which way to come out). Computed
        values speak first; parameters (placeholders) are weak evidence, since they are often
        gathered anyway, so past them the consumer's own consumers are asked."""
        for user in node.users:
            if user.op != "call_function" or user.target in (CONSTRAIN, operator.getitem):
                continue
            try:
                rule, operands = self.rule(user)
            except ShardingError:
                continue
            # the optimizer update runs where its state lies: its parameter and moments, though
            # arguments, say where the gradient is wanted (reduce-scattered, not all-reduced)
            update = user.target is _ADAMW
            if node not in operands or (len(rule.outputs) != 1 and not update):
                continue
            factors: dict[str, Axes] = {}
            for o, toks in zip(operands, rule.operands, strict=True):
                s = self.result.value.get(o) if o is not node and (update or o.op != "placeholder") else None
                if isinstance(s, Sharding) and len(s.dims) == len(toks):
                    for t, axes in zip(toks, s.dims, strict=True):
                        if t and axes and t[0] not in rule.reductions:
                            factors.setdefault(t[0], axes)
            if not factors and depth < 3 and not rule.reductions:
                later = self.consumer_hint(user, depth + 1)
                if later is not None and len(later) == len(rule.outputs[0]):
                    factors = {
                        t[0]: axes for t, axes in zip(rule.outputs[0], later, strict=True) if t and axes
                    }
            if not factors:
                continue
            toks = rule.operands[operands.index(node)]
            dims = tuple(factors.get(t[0]) if t else None for t in toks)
            flat = [x for d in dims if d for x in d]
            if any(d is not None for d in dims) and len(flat) == len(set(flat)):
                return dims
        return None
