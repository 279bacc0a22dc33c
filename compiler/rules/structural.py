"""Rule builders for structural ops: embedding, index_put, layer norm, split/cat, slice/select,
index_select, tril/triu. Dims whose values depend on global positions (a slice's dim, a cat's dim,
a normalized dim, a vocabulary) are marked ``!``: they stay replicated; every other dim passes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.fx import Node

from compiler.rules.builders import Built, arg, shape_of
from compiler.rules.notation import letters, line


def _dims(n: int, dim: int, mark: str, start: int = 0) -> list[str]:
    names = letters(n, start)
    return [f"{name}{mark}" if k == dim else name for k, name in enumerate(names)]


def _norm(dim: Any, ndim: int) -> int:
    return int(dim) % max(ndim, 1)


def embedding(node: Node) -> Built:
    weight, idx = arg(node, 0), arg(node, 1)
    ishape = shape_of(idx)
    it = letters(len(ishape), 1)
    return line([["v!", "e"], it], [[*it, "e"]]), "first", [weight, idx]


def layer_norm(node: Node) -> Built:
    x, normalized, w, b = arg(node, 0), arg(node, 1), arg(node, 2), arg(node, 3)
    xs = shape_of(x)
    k = len(normalized)
    lead = letters(len(xs) - k)
    normed = [f"n{j}!" for j in range(k)]
    operands, tokens = [x], [[*lead, *normed]]
    for t in (w, b):
        if isinstance(t, Node):
            operands.append(t)
            tokens.append(normed)
    stats = [*lead, *(["1"] * k)]
    return line(tokens, [[*lead, *normed], stats, stats]), "none", operands


def split(node: Node) -> Built:
    x = arg(node, 0)
    xs = shape_of(x)
    dim = _norm(arg(node, 2, node.kwargs.get("dim", 0)), len(xs))
    outs = node.meta["val"]
    names = letters(len(xs))
    ins = [f"{n}!" if k == dim else n for k, n in enumerate(names)]
    tokens = [[f"s{j}!" if k == dim else n for k, n in enumerate(names)] for j in range(len(outs))]
    return line([ins], tokens), "one", [x]


def cat(node: Node) -> Built:
    tensors = [t for t in arg(node, 0) if isinstance(t, Node) and shape_of(t) != (0,)]
    out = shape_of(node)
    dim = _norm(arg(node, 1, node.kwargs.get("dim", 0)), len(out))
    names = letters(len(out))
    toks = [[f"c{j}!" if k == dim else n for k, n in enumerate(names)] for j in range(len(tensors))]
    return line(toks, [[f"out{k}!" if k == dim else n for k, n in enumerate(names)]]), "all", tensors


def slice_(node: Node) -> Built:
    x = arg(node, 0)
    xs = shape_of(x)
    dim = _norm(arg(node, 1, 0), len(xs))
    names = letters(len(xs))
    if shape_of(node)[dim] == xs[dim] and (arg(node, 4, 1) or 1) == 1:
        return line([names], [names]), "one", [x]  # the whole dim: a no-op slice
    return (
        line([_dims(len(xs), dim, "!")], [["o!" if k == dim else n for k, n in enumerate(names)]]),
        "one",
        [x],
    )


def select(node: Node) -> Built:
    x = arg(node, 0)
    xs = shape_of(x)
    dim = _norm(arg(node, 1), len(xs))
    names = letters(len(xs))
    return line([_dims(len(xs), dim, "!")], [[n for k, n in enumerate(names) if k != dim]]), "one", [x]


def slice_scatter(node: Node) -> Built:
    x, src = arg(node, 0), arg(node, 1)
    xs = shape_of(x)
    dim = _norm(arg(node, 2, node.kwargs.get("dim", 0)), len(xs))
    names = letters(len(xs))
    src_t = ["s!" if k == dim else n for k, n in enumerate(names)]
    return line([_dims(len(xs), dim, "!"), src_t], [_dims(len(xs), dim, "!")]), "none", [x, src]


def triangle(node: Node) -> Built:
    """tril / triu: which elements survive depends on their global row and column."""
    x = arg(node, 0)
    n = len(shape_of(x))
    names = [f"{name}!" if k >= n - 2 else name for k, name in enumerate(letters(n))]
    return line([names], [names]), "one", [x]


def reduce_any(node: Node, dims: Sequence[int] | None = None) -> Built:
    from compiler.rules.builders import reduction

    return reduction(node, kind="max")


def lookup(node: Node, table_first: bool) -> Built:
    """bucketize(x, boundaries) / searchsorted(sorted, x): the 1-D table stays whole, the queried
    values pass through."""
    table, x = (arg(node, 0), arg(node, 1)) if table_first else (arg(node, 1), arg(node, 0))
    if len(shape_of(table)) != 1:
        raise KeyError("a batched lookup table")
    names = letters(len(shape_of(x)))
    operands, tokens = ([table, x], [["t!"], names]) if table_first else ([x, table], [names, ["t!"]])
    return line(tokens, [names]), "none", operands


def bias_contraction(node: Node) -> Built:
    """addmv(bias, mat, vec) / addbmm(bias, b1, b2): a bias added to a contraction is not linear in
    a pending sum (each device would add it), so the contracted dims stay whole. The bias
    broadcasts against the result like any elementwise operand."""
    bias, a, b = arg(node, 0), arg(node, 1), arg(node, 2)
    out = shape_of(node)
    names = ["i", "j"][: len(out)]
    bs = shape_of(bias)
    off = len(out) - len(bs)
    bt = [names[off + k] if bs[k] == out[off + k] else "1" for k in range(len(bs))]
    if len(shape_of(a)) == 2:  # addmv
        return line([bt, ["i", "k!"], ["k!"]], [["i"]]), "none", [bias, a, b]
    return line([bt, ["b!", "i", "k!"], ["b!", "k!", "j"]], [["i", "j"]]), "none", [bias, a, b]


def two_outputs(node: Node) -> Built:
    """frexp: elementwise with two results."""
    x = arg(node, 0)
    names = letters(len(shape_of(x)))
    return line([names], [names, names]), "none", [x]


def pool_backward(node: Node) -> Built:
    """max_pool2d_with_indices_backward(grad, x, ..., indices): (batch, channel) pass through."""
    grad, x, idx = arg(node, 0), arg(node, 1), arg(node, 7)
    n = len(shape_of(x))
    lead = [f"l{k}" for k in range(n - 2)]
    return (
        line([[*lead, "g0!", "g1!"], [*lead, "s0!", "s1!"], [*lead, "g0!", "g1!"]], [[*lead, "s0!", "s1!"]]),
        "none",
        [grad, x, idx],
    )
