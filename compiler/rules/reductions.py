"""Rule builders for value-dependent reductions, scans, sorts and shape ops.

The dims these ops compare, accumulate or rearrange along must stay whole (``!``); every other dim
passes through. Ops that return (values, indices) give both outputs the same factors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.fx import Node

from compiler.rules.builders import Built, arg, is_zeros, shape_of
from compiler.rules.notation import letters, line


def _norm(dims: Any, n: int) -> set[int]:
    if dims is None or dims == []:
        return set(range(n))
    seq = dims if isinstance(dims, Sequence) else [dims]
    return {int(d) % max(n, 1) for d in seq}


def _outputs(node: Node) -> int:
    vals = node.meta["val"]
    return len(vals) if isinstance(vals, (tuple, list)) else 1


def along(
    node: Node, dim_arg: int = 1, default: Any = None, keep_arg: int | None = None, drops: bool = True
) -> Built:
    """A reduction along ``dims`` that needs the whole dim (argmax, prod, var, median, max.dim...).

    ``drops``: the dim disappears unless keepdim; otherwise the output keeps every dim (sort, scans).
    """
    x = arg(node, 0)
    n = len(shape_of(x))
    dims = _norm(arg(node, dim_arg, node.kwargs.get("dim", default)), n)
    default_keep = node.kwargs.get("keepdim", False)  # keyword-only in some overloads (var)
    keep = bool(arg(node, keep_arg, default_keep)) if keep_arg is not None else bool(default_keep)
    names = letters(n)
    ins = [f"{f}!" if k in dims else f for k, f in enumerate(names)]
    if drops:
        out = [("1" if keep else None) if k in dims else f for k, f in enumerate(names)]
        toks = [t for t in out if t is not None]
    else:
        toks = ins
    # only a running sum is additive (the name test once let logcumsumexp through as linear)
    linear = "one" if str(node.target) == "aten.cumsum.default" else "none"
    return line([ins], [toks] * _outputs(node)), linear, [x]


def everything(node: Node) -> Built:
    """Ops over the whole tensor (prod(), max(), median() without dim): all dims whole."""
    x = arg(node, 0)
    ins = [f"{f}!" for f in letters(len(shape_of(x)))]
    outs = [
        [f"o{j}{k}!" for k in range(v.dim())]
        for j, v in enumerate(
            node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
        )
    ]
    return line([ins], outs), "none", [x]


def topk(node: Node) -> Built:
    x = arg(node, 0)
    n = len(shape_of(x))
    dim = int(arg(node, 2, node.kwargs.get("dim", -1))) % max(n, 1)
    names = letters(n)
    ins = [f"{f}!" if k == dim else f for k, f in enumerate(names)]
    out = ["k!" if k == dim else f for k, f in enumerate(names)]
    return line([ins], [out, out]), "none", [x]


def flip(node: Node) -> Built:
    return along(node, 1, drops=False)


def repeat(node: Node) -> Built:
    """repeat(x, reps): new leading dims and repeated dims are whole; others pass through."""
    x = arg(node, 0)
    reps = list(arg(node, 1))
    n, out_n = len(shape_of(x)), len(reps)
    names = letters(n, out_n - n)
    ins = [f"{f}!" if reps[out_n - n + k] != 1 else f for k, f in enumerate(names)]
    out = [f"r{k}!" for k in range(out_n - n)] + [
        f"o{k}!" if reps[out_n - n + k] != 1 else f for k, f in enumerate(names)
    ]
    return line([ins], [out]), "none", [x]


def pad(node: Node) -> Built:
    """constant_pad_nd: padded dims (the last len(pad)/2, innermost first) are whole."""
    x = arg(node, 0)
    p = list(arg(node, 1))
    n = len(shape_of(x))
    padded = {n - 1 - k for k in range(len(p) // 2) if p[2 * k] or p[2 * k + 1]}
    names = letters(n)
    ins = [f"{f}!" if k in padded else f for k, f in enumerate(names)]
    out = [f"o{k}!" if k in padded else f for k, f in enumerate(names)]
    return line([ins], [out]), "none", [x]


def unbind(node: Node) -> Built:
    x = arg(node, 0)
    n = len(shape_of(x))
    dim = int(arg(node, 1, 0)) % max(n, 1)
    names = letters(n)
    ins = [f"{f}!" if k == dim else f for k, f in enumerate(names)]
    out = [f for k, f in enumerate(names) if k != dim]
    return line([ins], [out] * _outputs(node)), "one", [x]


def diagonal(node: Node) -> Built:
    x = arg(node, 0)
    n = len(shape_of(x))
    d1 = int(arg(node, 2, node.kwargs.get("dim1", 0))) % n
    d2 = int(arg(node, 3, node.kwargs.get("dim2", 1))) % n
    names = letters(n)
    ins = [f"{f}!" if k in (d1, d2) else f for k, f in enumerate(names)]
    out = [f for k, f in enumerate(names) if k not in (d1, d2)] + ["diag!"]
    return line([ins], [out]), "one", [x]


def diagonal_scatter(node: Node) -> Built:
    """diagonal_scatter(self, src, offset, dim1, dim2) (diagonal's backward): the diagonal's dims
    stay whole, the rest pass through. Writing is additive in (self, src) together, or in src
    alone when self is zeros."""
    x, src = arg(node, 0), arg(node, 1)
    n = len(shape_of(x))
    d1 = int(arg(node, 3, node.kwargs.get("dim1", 0))) % n
    d2 = int(arg(node, 4, node.kwargs.get("dim2", 1))) % n
    names = letters(n)
    xt = [f"{f}!" if k in (d1, d2) else f for k, f in enumerate(names)]
    st = [f for k, f in enumerate(names) if k not in (d1, d2)] + ["diag!"]
    return line([xt, st], [xt]), "last" if is_zeros(x) else "all", [x, src]


def batched_matrix(node: Node) -> Built:
    """Linear-algebra ops that act on each matrix of a batch on its own: leading dims shared by all
    tensors pass through; the matrix dims (and anything else) stay whole."""
    operands = [a for a in node.args if isinstance(a, Node)]
    vals = node.meta["val"]
    outs = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    first = shape_of(operands[0])
    batch = len(first) - 2
    lead = letters(max(batch, 0))

    def tokens(shape: tuple[int, ...], tag: str) -> list[str]:
        k = batch if len(shape) >= batch and tuple(shape[:batch]) == tuple(first[:batch]) else 0
        return [*lead[:k], *(f"{tag}{j}!" for j in range(len(shape) - k))]

    ins = [tokens(shape_of(o), f"i{i}_") for i, o in enumerate(operands)]
    otoks = [tokens(tuple(v.shape), f"o{i}_") if v is not None else [] for i, v in enumerate(outs)]
    return line(ins, otoks), "none", operands
