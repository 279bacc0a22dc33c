"""Rule builders for advanced indexing: ``x[i0, :, i2]`` (aten.index.Tensor), its write-back
(index_put, the backward of indexing, padding and nearest/linear upsampling), index_select and
the ops that stay whole for want of a better rule.

Indexed dims of ``x`` stay whole (``!``): an index value names a global position. The index tensors
broadcast together to a shape ``B``; each dim of ``B`` is a factor shared by every index tensor of
that size (a size-1 index dim is a broadcast, ``1``), and the result holds ``B`` where the indexed
dims were (or first, when the indexed dims are not adjacent) with the other dims of ``x`` passing
through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from compiler.rules.builders import Built, arg, is_zeros, shape_of, tensor_args
from compiler.rules.notation import letters, line

Shape = tuple[int, ...]


def _broadcast(*shapes: Shape) -> Shape:
    out: list[int] = []
    for s in shapes:
        out = [1] * (len(s) - len(out)) + out
        for k, n in enumerate(s):
            j = len(out) - len(s) + k
            if n != 1:
                if out[j] not in (1, n):
                    raise KeyError("index shapes that do not broadcast")
                out[j] = n
    return tuple(out)


def _broadcast_tokens(shapes: list[Shape], out: Shape, names: list[str]) -> list[list[str]]:
    """Tokens of tensors that broadcast (aligned from the right) to ``out``, whose dims are ``names``."""
    rows = []
    for s in shapes:
        off = len(out) - len(s)
        if off < 0:
            raise KeyError("an index has more dims than the broadcast index shape")
        row = []
        for j, n in enumerate(s):
            if n == out[off + j]:
                row.append(names[off + j])
            elif n == 1:
                row.append("1")
            else:
                raise KeyError(f"index dim of size {n} against {out[off + j]}")
        rows.append(row)
    return rows


def _layout(
    x: Node, indices: list[Any]
) -> tuple[list[Node], list[str], list[list[str]], list[str], list[str]]:
    """(index tensors, x's tokens, the index tensors' tokens, the result's tokens, B's factors)."""
    xs = shape_of(x)
    if len(indices) > len(xs):
        raise KeyError("more indices than dims")
    idx = [i for i in indices if i is not None]
    if not idx or not all(isinstance(i, Node) for i in idx):
        raise KeyError("no index tensor")
    if any(i.meta["val"].dtype not in (torch.int64, torch.int32) for i in idx):
        raise KeyError("boolean-mask indexing")
    where = [k for k, i in enumerate(indices) if i is not None]
    bshape = _broadcast(*(shape_of(i) for i in idx))
    bnames = [f"b{j}" for j in range(len(bshape))]
    itoks = _broadcast_tokens([shape_of(i) for i in idx], bshape, bnames)
    names = letters(len(xs))
    xt = [f"x{k}!" if k in where else n for k, n in enumerate(names)]
    rest = [n for k, n in enumerate(names) if k not in where]
    if where == list(range(where[0], where[-1] + 1)):  # adjacent: B takes their place
        out = [*names[: where[0]], *bnames, *(n for k, n in enumerate(names) if k > where[-1])]
    else:
        out = [*bnames, *rest]
    return idx, xt, itoks, out, bnames


def index(node: Node) -> Built:
    """x[indices] (indices: index tensors or None per leading dim): linear in x."""
    x, indices = arg(node, 0), list(arg(node, 1))
    idx, xt, itoks, out, _ = _layout(x, indices)
    return line([xt, *itoks], [out]), "first", [x, *idx]


def index_put(node: Node) -> Built:
    """index_put(x, indices, values, accumulate): values broadcast to x[indices]'s shape. Accumulated
    onto zeros, positions are a sum over the index dims (split -> pending sum) and values may stay a
    pending sum; onto a nonzero base every device would add the base once, and without accumulate
    positions must stay whole, so then the index dims do."""
    x, indices, values = arg(node, 0), list(arg(node, 1)), arg(node, 2)
    if not shape_of(x) or any(isinstance(i, Node) and i.meta["val"].dtype == torch.bool for i in indices):
        return whole(node)  # a 0-dim base or a boolean mask: positions are not blocks of anything
    accumulate = bool(arg(node, 3, node.kwargs.get("accumulate", False)))
    if not isinstance(values, Node):
        raise KeyError("index_put with a scalar value")
    idx, xt, itoks, out, bnames = _layout(x, indices)
    summed = accumulate and is_zeros(x)
    if not summed:
        keep = set(bnames)
        itoks = [[t + "!" if t in keep else t for t in row] for row in itoks]
        out = [t + "!" if t in keep else t for t in out]
    sizes = _result_sizes(shape_of(x), indices)
    vt = _broadcast_tokens([shape_of(values)], sizes, out)[0]
    return line([xt, *itoks, vt], [xt]), "last" if summed else "none", [x, *idx, values]


def _result_sizes(xs: Shape, indices: list[Any]) -> Shape:
    where = [k for k, i in enumerate(indices) if i is not None]
    bshape = _broadcast(*(shape_of(i) for i in indices if i is not None))
    rest = [n for k, n in enumerate(xs) if k not in where]
    if where == list(range(where[0], where[-1] + 1)):
        return (*xs[: where[0]], *bshape, *xs[where[-1] + 1 :])
    return (*bshape, *rest)


def index_select(node: Node) -> Built:
    x, idx = arg(node, 0), arg(node, 2)
    xs = shape_of(x)
    if not xs:  # a 0-dim tensor: the index holds one position, the result is 0-dim too
        return line([[], ["i!"] * len(shape_of(idx))], [[]]), "first", [x, idx]
    dim = int(arg(node, 1)) % len(xs)
    names = letters(len(xs))
    ins = [f"{n}!" if k == dim else n for k, n in enumerate(names)]
    out = ["i" if k == dim else n for k, n in enumerate(names)]
    return line([ins, ["i"]], [out]), "first", [x, idx]


def whole(node: Node) -> Built:
    """Every dim of every operand and result stays whole: the op runs on gathered inputs, each
    device computing the full result (flat positions, data-dependent placement, mixed contractions)."""
    operands = tensor_args(node)
    for a in node.args:  # tensors in lists too
        if isinstance(a, (list, tuple)):
            operands += [t for t in a if isinstance(t, Node)]
    vals = node.meta["val"]
    outs = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    ins = [[f"i{j}_{k}!" for k in range(len(shape_of(o)))] for j, o in enumerate(operands)]
    otoks = [[f"o{j}_{k}!" for k in range(v.dim())] if v is not None else [] for j, v in enumerate(outs)]
    return line(ins, otoks), "none", operands
