"""Rule builders: render the one-line rule of a shape-polymorphic op from its node's shapes.

Every builder returns ``(rule line, linearity, tensor operands)``; the registry parses the line. The
operands are the node's tensor arguments the rule covers (creation ops such as ``full_like`` read only
their argument's shape, so they have none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node

from compiler.rules.notation import letters, line

Built = tuple[str, str, list[Node]]


def arg(node: Node, i: int, default: Any = None) -> Any:
    """Positional argument ``i`` of ``node`` (fx types arguments loosely)."""
    return node.args[i] if len(node.args) > i else default


def shape_of(n: Any) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def tensor_args(node: Node) -> list[Node]:
    return [a for a in node.args if isinstance(a, Node)]


def elementwise(node: Node, linear: str) -> Built:
    """Broadcasting elementwise op: operand dims align from the right with the output's.

    Every output dim must come from some operand of that size (else it is not elementwise: glu
    halves a dim, for one) — a dim only the output had would be split on a rank that computed it
    whole."""
    operands = tensor_args(node)
    out = shape_of(node)
    names = letters(len(out))
    tokens = []
    covered = [False] * len(out)
    for op in operands:
        s = shape_of(op)
        off = len(out) - len(s)
        if off < 0:
            raise KeyError("an operand has more dims than the result")
        row = []
        for j in range(len(s)):
            if s[j] == out[off + j]:
                row.append(names[off + j])
                covered[off + j] = True
            elif s[j] == 1:
                row.append("1")
            else:
                raise KeyError(f"operand dim of size {s[j]} against result size {out[off + j]}")
        tokens.append(row)
    if operands and not all(covered[k] or out[k] == 1 for k in range(len(out))):
        raise KeyError("a result dim no operand has")
    return line(tokens, [names]), linear, operands


def binary_arith(node: Node, all_tensor_linear: str) -> Built:
    """add/sub/mul/div with a Python scalar in either position: ``c - h`` and ``h + c`` add ``c``
    once per device if ``h`` stays a pending sum, and ``c / h`` is not linear at all; only scaling
    (``c * h``, ``h / c``) is. Linearity is decided per call, never from the op alone."""
    scalars = [k for k, a in enumerate(node.args[:2]) if not isinstance(a, Node)]
    if not scalars:
        return elementwise(node, all_tensor_linear)
    target = str(node.target)
    given = node.args[scalars[0]]
    # x * inf or x / 0 of a pending sum would turn parts of opposite sign into inf - inf = nan
    finite = isinstance(given, (int, float)) and math.isfinite(given)
    c = float(given) if finite else 0.0  # type: ignore[arg-type]
    # fp16 tops out at 65504: a scale that grows the parts could overflow one the sum would not
    narrow = node.meta["val"].dtype == torch.float16
    if "mul" in target and finite and not (narrow and abs(c) > 1):
        return elementwise(node, "one")
    if "div" in target and scalars == [1] and finite and c != 0 and not (narrow and abs(c) < 1):
        return elementwise(node, "first")
    return elementwise(node, "none")


def cast(node: Node) -> Built:
    """_to_copy: a cast that represents every value of its input exactly (same dtype, fp32 ->
    fp64, bf16 -> fp32, int16 -> fp32) commutes with a pending sum. A narrowing cast does not:
    each device's part would be rounded on its own, an error on the scale of the parts rather than
    of their sum (fp32 parts 1000.25 and -1000 cast to bf16 sum to 0, not 0.25); nor does a cast
    to an integer or bool dtype, which truncates each part."""
    x = node.args[0]
    assert isinstance(x, Node)
    src, dst = x.meta["val"].dtype, node.meta["val"].dtype
    return elementwise(node, "one" if _exact_cast(src, dst) else "none")


def _precision(dtype: torch.dtype) -> tuple[int, float, float]:
    """(significant bits, largest finite value, smallest normal value) of a real dtype."""
    if dtype.is_floating_point:
        f = torch.finfo(dtype)
        return round(-math.log2(f.eps)) + 1, f.max, f.tiny
    i = torch.iinfo(dtype)
    return i.bits - (1 if i.min < 0 else 0), float(i.max), 1.0


def exact_linearity(node: Node, linear: str, operands: list[Node]) -> str:
    """``linear`` narrowed to the operands whose dtype the result's holds exactly. A pending int64
    sum of parts 1000000004 and -1000000000 divided by 2 (or cast, or multiplied by a float
    tensor) in fp32 loses each part's low digits; the sum, 4, has none to lose. Bool operands
    are never pending sums and do not count."""
    if linear == "none":
        return linear
    vals = node.meta["val"]
    out = next((v for v in (vals if isinstance(vals, (tuple, list)) else [vals]) if v is not None), None)
    if out is None:
        return linear
    inexact = {
        k
        for k, o in enumerate(operands)
        if (dtype := o.meta["val"].dtype) != torch.bool and not _exact_cast(dtype, out.dtype)
    }
    if not inexact:
        return linear
    last = len(operands) - 1
    if linear == "all" or (linear == "first" and 0 in inexact) or (linear == "last" and last in inexact):
        return "none"
    if linear != "one":
        return linear
    exact = set(range(len(operands))) - inexact
    return "first" if exact == {0} else "last" if exact == {last} else "none"


def _exact_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether casting ``src`` to the floating ``dst`` keeps every value (so casting parts and
    summing equals summing and casting, up to the sum's own rounding)."""
    if src == dst:
        return True
    if src == torch.bool or not (dst.is_floating_point or dst.is_complex):
        return False
    if src.is_complex and not dst.is_complex:
        return False
    src, dst = src.to_real(), dst.to_real()
    bits, top, low = _precision(src)
    dst_bits, dst_top, dst_low = _precision(dst)
    return dst_bits >= bits and dst_top >= top and dst_low <= low


def is_zeros(n: Any) -> bool:
    """A value known to be all zeros from how it was made (zeros, new_zeros, full(..., 0)): the
    one base a pending sum may be added onto, since every device adding it adds nothing."""
    if not isinstance(n, Node) or n.op != "call_function":
        return False
    name = str(n.target).split(".")[1] if str(n.target).startswith("aten.") else ""
    if name in ("zeros", "zeros_like", "new_zeros"):
        return True
    fill = {"full": 1, "full_like": 1, "new_full": 2}.get(name)
    value = n.args[fill] if fill is not None and len(n.args) > fill else None
    return isinstance(value, (int, float)) and value == 0


_EMPTY_REDUCES_NONE = (torch.ops.aten.any.dims, torch.ops.aten.all.dims)


def reduction(node: Node, kind: str) -> Built:
    """sum / amax-style reductions over ``dims`` (all dims when absent), with keepdim."""
    x = node.args[0]
    assert isinstance(x, Node)
    shape = shape_of(x)
    dims = arg(node, 1)
    keep = bool(arg(node, 2, node.kwargs.get("keepdim", False)))
    if dims in (None, []):  # all dims, except any/all.dims, where an empty list reduces none
        reduced = set() if dims == [] and node.target in _EMPTY_REDUCES_NONE else set(range(len(shape)))
    else:
        reduced = {d % max(len(shape), 1) for d in (dims if isinstance(dims, Sequence) else [dims])}
    names = letters(len(shape))
    mark = "!" if kind == "max" else ""
    ins = [n + (mark if i in reduced else "") for i, n in enumerate(names)]
    outs = [("1" if keep else None) if i in reduced else n for i, n in enumerate(names)]
    return line([ins], [[o for o in outs if o is not None]]), "one" if kind == "sum" else "none", [x]


def permute(node: Node) -> Built:
    x = node.args[0]
    assert isinstance(x, Node)
    n = len(shape_of(x))
    names = letters(n)
    target = str(node.target)
    if "permute" in target:
        order = [d % n for d in arg(node, 1)]
    elif "transpose" in target:
        a, b = int(arg(node, 1)) % n, int(arg(node, 2)) % n
        order = list(range(n))
        order[a], order[b] = order[b], order[a]
    else:  # t
        order = list(reversed(range(n)))
    return line([names], [[names[i] for i in order]]), "one", [x]


def view(node: Node) -> Built:
    """view/reshape/squeeze/unsqueeze: dims grouped by equal products; splits and merges become
    compound factors ``(a b)``; groups that both split and merge keep their factors replicated.

    Size-1 dims get no factor (``1``) on either side: matching by size cannot tell which size-1 dim
    became which, so a split size-1 dim (blocks of 1 and 0) is gathered before a view, never moved.
    """
    x = arg(node, 0)
    assert isinstance(x, Node)
    src, dst = shape_of(x), shape_of(node)
    if 0 in src or 0 in dst:  # nothing to match sizes by: every dim whole (there is no data)
        return line([[f"e{k}!" for k in range(len(src))]], [[f"o{k}!" for k in range(len(dst))]]), "one", [x]
    src_big = [k for k, n in enumerate(src) if n != 1]
    dst_big = [k for k, n in enumerate(dst) if n != 1]
    ins = ["1"] * len(src)
    outs = ["1"] * len(dst)
    i = j = 0
    counter = 0

    def fresh() -> str:
        nonlocal counter
        counter += 1
        return f"f{counter}"

    while i < len(src_big) or j < len(dst_big):
        gi, gj = [src_big[i]], [dst_big[j]]
        pi, pj = src[gi[0]], dst[gj[0]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(src_big[i])
                pi *= src[src_big[i]]
                i += 1
            else:
                gj.append(dst_big[j])
                pj *= dst[dst_big[j]]
                j += 1
        if len(gi) == 1 and len(gj) == 1:
            f = fresh()
            ins[gi[0]], outs[gj[0]] = f, f
        elif len(gi) == 1:  # split
            fs = [fresh() for _ in gj]
            ins[gi[0]] = "(" + " ".join(fs) + ")"
            for k, f in zip(gj, fs, strict=True):
                outs[k] = f
        elif len(gj) == 1:  # merge
            fs = [fresh() for _ in gi]
            for k, f in zip(gi, fs, strict=True):
                ins[k] = f
            outs[gj[0]] = "(" + " ".join(fs) + ")"
        else:
            for k in gi:
                ins[k] = fresh() + "!"
            for k in gj:
                outs[k] = fresh() + "!"
    assert math.prod(src) == math.prod(dst)
    return line([ins], [outs]), "one", [x]


def expand(node: Node) -> Built:
    x = node.args[0]
    assert isinstance(x, Node)
    src, dst = shape_of(x), shape_of(node)
    names = letters(len(dst))
    off = len(dst) - len(src)
    ins = [names[off + k] if src[k] == dst[off + k] else "1" for k in range(len(src))]
    return line([ins], [names]), "one", [x]


def creation(node: Node) -> Built:
    """full / zeros / scalar_tensor / *_like: no tensor operand; any output split is a local fill."""
    return line([], [letters(len(shape_of(node)))]), "none", []


def positional(node: Node) -> Built:
    """arange and friends: values depend on the position, so the output stays replicated."""
    return line([], [[n + "!" for n in letters(len(shape_of(node)))]]), "none", []


def softmax_like(node: Node, operands: int, linear: str) -> Built:
    """_log_softmax / _softmax (and their backward): the softmax dim stays replicated."""
    xs = tensor_args(node)[:operands]
    shape = shape_of(xs[0])
    dim = int(arg(node, operands)) % max(len(shape), 1)  # a 0-dim value is its own softmax dim
    names = [n + ("!" if k == dim else "") for k, n in enumerate(letters(len(shape)))]
    return line([names] * operands, [names]), linear, xs


def _index_tokens(
    xs: tuple[int, ...], ids: tuple[int, ...], dim: int, index_dim_whole: bool
) -> tuple[list[str], list[str]]:
    """Factors of gather/scatter's input and index: dims other than ``dim`` where the sizes agree
    are shared; the rest stay whole, except the index's own ``dim`` when a gather may split it."""
    xt, it = [], []
    for k in range(len(xs)):
        if k != dim and xs[k] == ids[k]:
            xt.append(f"d{k}")
            it.append(f"d{k}")
        else:
            xt.append(f"x{k}!")
            it.append(f"i{k}" if k == dim and not index_dim_whole else f"i{k}!")
    return xt, it


def gather(node: Node) -> Built:
    x, idx = arg(node, 0), arg(node, 2)
    assert isinstance(x, Node) and isinstance(idx, Node)
    dim = int(arg(node, 1)) % max(len(shape_of(x)), 1)
    xt, it = _index_tokens(shape_of(x), shape_of(idx), dim, index_dim_whole=False)
    return line([xt, it], [it]), "first", [x, idx]


def scatter(node: Node) -> Built:
    x, idx = arg(node, 0), arg(node, 2)
    assert isinstance(x, Node) and isinstance(idx, Node)
    dim = int(arg(node, 1)) % max(len(shape_of(x)), 1)
    src = node.args[3] if len(node.args) > 3 and isinstance(node.args[3], Node) else None
    xt, it = _index_tokens(shape_of(x), shape_of(idx), dim, index_dim_whole=True)
    operands, tokens = [x, idx], [xt, it]
    if src is not None:
        # src may be larger than the index (only its leading part is read): where it is, the
        # index's blocks would not line up with src's, so that dim stays whole
        ss, ids = shape_of(src), shape_of(idx)
        st = [t if ss[k] == ids[k] else f"s{k}!" for k, t in enumerate(it)]
        it = [t if ss[k] == ids[k] or t.endswith("!") else t + "!" for k, t in enumerate(it)]
        operands.append(src)
        tokens = [xt, it, st]
    return line(tokens, [xt]), "none", operands


def batched_matmul(node: Node) -> Built:
    """shardspec::matmul: leading batch dims pass through, the last two contract like mm."""
    a, b = arg(node, 0), arg(node, 1)
    lead = letters(len(shape_of(a)) - 2)
    return line([[*lead, "i", "k"], [*lead, "k", "j"]], [[*lead, "i", "j"]]), "one", [a, b]
