"""The factor-rule notation: one einsum-like line per op.

``"i k, k j -> i j"``: one space-separated token list per tensor operand, ``->``, then one per output.
A 0-dim tensor is written ``.``. A token is a factor name, ``1`` (a size-1 broadcast dim, no
factor), or ``(a b)`` (a dim that is the merge of factors a and b, a major: views that split or merge
dims). Factors in an operand but in no
output are reductions: split over axes, they leave the output Partial (a pending sum) over those axes.
A factor marked ``!`` anywhere must stay replicated (softmax's dim, gather's dim, a max-reduction).
Factors only in outputs are free: the output may be split over them by a local slice.

``linear`` says which operands may stay Partial through the op without being reduced first:
``"all"`` (add/sub: every operand Partial over the same axes), ``"one"`` (one Partial operand, the
rest not: mul, mm, sum, views, casts), ``"first"`` / ``"last"`` (only that operand: div's numerator,
index_put's values), ``"none"``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

Dim = tuple[str, ...]  # the factors of one dim, major first; () for a size-1 broadcast dim

_TOKEN = re.compile(r"\(([^()]*)\)|(\S+)")


@dataclass(frozen=True)
class Rule:
    text: str
    operands: tuple[tuple[Dim, ...], ...]
    outputs: tuple[tuple[Dim, ...], ...]
    replicated: frozenset[str]
    linear: str = "none"

    @functools.cached_property
    def factors(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for side in (self.operands, self.outputs):
            for dims in side:
                for dim in dims:
                    for f in dim:
                        seen.setdefault(f)
        return tuple(seen)

    @functools.cached_property
    def reductions(self) -> frozenset[str]:
        out = {f for dims in self.outputs for dim in dims for f in dim}
        return frozenset(f for dims in self.operands for dim in dims for f in dim if f not in out)

    @functools.cached_property
    def minor(self) -> frozenset[str]:
        """Non-leading factors of merged dims: they cannot be split (the dim would not be a block)."""
        return frozenset(
            f for side in (self.operands, self.outputs) for dims in side for dim in dims for f in dim[1:]
        )


def _parse_side(text: str) -> tuple[tuple[tuple[Dim, ...], ...], set[str]]:
    tensors: list[tuple[Dim, ...]] = []
    marked: set[str] = set()
    if not text.strip():
        return (), marked
    for part in text.split(","):
        dims: list[Dim] = []
        if part.strip() == ".":  # a 0-dim tensor
            tensors.append(())
            continue
        for m in _TOKEN.finditer(part):
            group, word = m.group(1), m.group(2)
            names = group.split() if group is not None else [word]
            factors = []
            for name in names:
                if name.endswith("!"):
                    name = name[:-1]
                    marked.add(name)
                if name != "1":
                    factors.append(name)
            dims.append(tuple(factors))
        tensors.append(tuple(dims))
    return tuple(tensors), marked


@functools.lru_cache(maxsize=4096)
def parse(text: str, linear: str = "none") -> Rule:
    """Parse one rule line (see module docstring). Memoized: rules are immutable values, and a deep
    model asks for the same few lines once per op."""
    if "->" not in text:
        raise ValueError(f"rule {text!r} has no '->'")
    lhs, rhs = text.split("->")
    operands, m1 = _parse_side(lhs)
    outputs, m2 = _parse_side(rhs)
    if linear not in ("all", "one", "first", "last", "none"):
        raise ValueError(f"rule {text!r}: linear={linear!r}")
    return Rule(text.strip(), operands, outputs, frozenset(m1 | m2), linear)


def letters(n: int, start: int = 0) -> list[str]:
    """Factor names d0, d1, ... for generated rules."""
    return [f"d{i}" for i in range(start, start + n)]


def line(operands: list[list[str]], outputs: list[list[str]]) -> str:
    """Render token lists back into a rule line."""

    def side(ts: list[list[str]]) -> str:
        return ", ".join(" ".join(t) if t else "." for t in ts)

    return f"{side(operands)} -> {side(outputs)}"
