"""Rule builders for sliding windows (unfold), pairwise distances, FFTs, grid sampling and the
complex views: the dims an op transforms, measures or samples along stay whole (``!``); batch
dims pass through.
"""

from __future__ import annotations

from typing import Any

from torch.fx import Node

from compiler.rules.builders import Built, arg, shape_of
from compiler.rules.notation import letters, line


def _dims(dims: Any, n: int) -> set[int]:
    seq = dims if isinstance(dims, (list, tuple)) else [dims]
    return {int(d) % max(n, 1) for d in seq}


def unfold(node: Node) -> Built:
    """x.unfold(dim, size, step): the windowed dim and the new window dim are whole."""
    x = arg(node, 0)
    n = len(shape_of(x))
    if n == 0:
        return line([[]], [["w!"]]), "one", [x]
    dim = int(arg(node, 1)) % n
    names = letters(n)
    ins = [f"{f}!" if k == dim else f for k, f in enumerate(names)]
    out = [*("o!" if k == dim else f for k, f in enumerate(names)), "w!"]
    return line([ins], [out]), "one", [x]


def unfold_backward(node: Node) -> Built:
    """unfold_backward(grad, input_sizes, dim, size, step): windows summed back onto the input."""
    grad = arg(node, 0)
    n = len(shape_of(node))
    if n == 0:
        return line([["w!"]], [[]]), "first", [grad]
    dim = int(arg(node, 2)) % n
    names = letters(n)
    out = [f"{f}!" if k == dim else f for k, f in enumerate(names)]
    g = [*("o!" if k == dim else f for k, f in enumerate(names)), "w!"]
    return line([g], [out]), "first", [grad]


def _batch(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[list[str], list[str], list[str]]:
    """Broadcast batch tokens of two operands (same rank) and of the result."""
    ta, tb, out = [], [], []
    for k, (m, n) in enumerate(zip(a, b, strict=True)):
        f = f"b{k}"
        if m != n and 1 not in (m, n):
            raise KeyError("batch dims that do not broadcast")
        ta.append(f if m == max(m, n) else "1")
        tb.append(f if n == max(m, n) else "1")
        out.append(f)
    return ta, tb, out


def cdist(node: Node) -> Built:
    """_cdist_forward(x1 (.., P, M), x2 (.., R, M), p, mode) -> (.., P, R): rows pass through, the
    feature dim M is inside a norm, so whole."""
    x1, x2 = arg(node, 0), arg(node, 1)
    s1, s2 = shape_of(x1), shape_of(x2)
    if len(s1) != len(s2):
        raise KeyError("cdist operands of different ranks")
    t1, t2, out = _batch(s1[:-2], s2[:-2])
    return line([[*t1, "p", "m!"], [*t2, "r", "m!"]], [[*out, "p", "r"]]), "none", [x1, x2]


def cdist_backward(node: Node) -> Built:
    """_cdist_backward(grad, x1, x2, p, cdist) -> grad of x1: a sum over x2's rows (kept whole)."""
    g, x1, x2, d = arg(node, 0), arg(node, 1), arg(node, 2), arg(node, 4)
    if not (len(shape_of(x1)) == len(shape_of(x2)) == len(shape_of(g)) == 2 + len(shape_of(x1)[:-2])):
        raise KeyError("cdist_backward ranks")
    if shape_of(x1)[:-2] != shape_of(x2)[:-2]:
        raise KeyError("cdist_backward with broadcast batch dims")
    b = letters(len(shape_of(x1)) - 2)
    gt = [*b, "p", "r!"]
    return line([gt, [*b, "p", "m!"], [*b, "r!", "m!"], gt], [[*b, "p", "m!"]]), "none", [g, x1, x2, d]


def fft(node: Node) -> Built:
    """_fft_r2c / _fft_c2c / _fft_c2r(x, dim, ...): the transformed dims are whole."""
    x = arg(node, 0)
    n = len(shape_of(x))
    dims = _dims(arg(node, 1), n)
    names = letters(n)
    ins = [f"{f}!" if k in dims else f for k, f in enumerate(names)]
    out = [f"o{k}!" if k in dims else f for k, f in enumerate(names)]
    return line([ins], [out]), "none", [x]


def view_as_real(node: Node) -> Built:
    x = arg(node, 0)
    names = letters(len(shape_of(x)))
    return line([names], [[*names, "c!"]]), "none", [x]


def view_as_complex(node: Node) -> Built:
    x = arg(node, 0)
    names = letters(len(shape_of(x)) - 1)
    return line([[*names, "c!"]], [names]), "none", [x]


def grid_sampler(node: Node) -> Built:
    """grid_sampler_2d/3d(input (N, C, *S), grid (N, *T, k)) -> (N, C, *T): batch, channels and
    the sampled positions pass through; the sampled-from dims and the coordinate dim are whole."""
    x, grid = arg(node, 0), arg(node, 1)
    s = len(shape_of(x)) - 2
    src = [f"s{k}!" for k in range(s)]
    pos = [f"t{k}" for k in range(s)]
    return line([["n", "c", *src], ["n", *pos, "k!"]], [["n", "c", *pos]]), "none", [x, grid]


def grid_sampler_backward(node: Node) -> Built:
    """grid_sampler_2d/3d_backward(grad, input, grid, ...) -> (grad_input, grad_grid): grad_input
    sums over the sampled positions and grad_grid over channels, so only the batch passes through."""
    g, x, grid = arg(node, 0), arg(node, 1), arg(node, 2)
    s = len(shape_of(x)) - 2
    src = [f"s{k}!" for k in range(s)]
    pos = [f"t{k}!" for k in range(s)]
    xt, gt = ["n", "c!", *src], ["n", *pos, "k!"]
    vals = node.meta["val"]
    outs = [xt if vals[0] is not None else [], gt if vals[1] is not None else []]
    return line([["n", "c!", *pos], xt, gt], outs), "none", [g, x, grid]
