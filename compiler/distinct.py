"""One value in two operand slots that its op's rule lays out differently gets a second node.

Propagation and partition place each operand node once: ``a @ a`` asks for ``a`` split by rows as
the left operand and by columns (or whole) as the right, and a node has one layout per use site. So
before propagation, each later use of such a value goes through an ``alias_copy`` (an identity with
an elementwise rule, free where the layouts agree), and every operand slot is a node of its own.
Ops whose rule lays the repeated operand out the same way in every slot (``x * x``) are left alone.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from compiler.rules.registry import MissingRule, rule_for

aten = torch.ops.aten


def split_shared_operands(graph: Graph) -> None:
    """Give each conflicting repeated operand its own ``alias_copy`` node (in place)."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        tensors = [a for a in node.args if isinstance(a, Node)]
        if len(tensors) == len(set(tensors)) or not _conflicting(node):
            continue
        seen: set[Node] = set()
        args = []
        for a in node.args:
            if isinstance(a, Node) and a in seen:
                with graph.inserting_before(node):
                    copy = graph.call_function(aten.alias_copy.default, (a,))
                copy.meta = {k: v for k, v in node.meta.items() if k != "val"}  # the user's line
                copy.meta["val"] = a.meta["val"]
                args.append(copy)
            else:
                if isinstance(a, Node):
                    seen.add(a)
                args.append(a)
        node.args = tuple(args)


def _conflicting(node: Node) -> bool:
    """Whether the rule gives one repeated operand different dims in different slots."""
    try:
        rule, operands = rule_for(node)
    except MissingRule:
        return False
    return any(
        operands[i] is operands[j] and rule.operands[i] != rule.operands[j]
        for i in range(len(operands))
        for j in range(i + 1, len(operands))
    )
