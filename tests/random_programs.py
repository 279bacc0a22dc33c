"""A hypothesis strategy for random tensor programs, and a runnable reproducer for each.

A program is straight-line Python over ``torch`` (one op per line, values reused, so a DAG): matmuls
and einsums, convolutions, norms, softmax, cross-entropy, embeddings, views and permutes, cat / split,
slicing and indexing, gather, reductions, elementwise ops with Python scalars on either side,
where / masked_fill, cumsum and attention. Every line is evaluated on meta tensors while it is drawn,
so programs are shape-consistent by construction and a generator bug surfaces at draw time. Inputs are
float64 tensors (differentiated), integer index / target tensors and boolean masks; the program returns
every computed value no later line consumes.

``Case.script()`` is a self-contained script (inputs from a seeded generator, mesh, specs, the step
with ``value_and_grad``); the property test executes exactly that text, so a failure prints code that
reproduces it.
"""

from __future__ import annotations

import itertools
import linecache
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from shardspec import Mesh, P
from tests.strategies import meshes, specs

Shape = tuple[int, ...]
_SCRIPT_IDS = itertools.count()
MAX_RANK = 4
MAX_NUMEL = 1024
SCALARS = (1.0, 2.0, 0.5, 3, 2, -1.5)


@dataclass(frozen=True)
class Input:
    """One argument of a program: ``float`` (float64, differentiated), ``index`` / ``target`` (int64 in
    ``[0, high)``; targets also hold ignore_index -100) or ``mask`` (bool)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    high: int = 0

    def code(self) -> str:
        s = repr(self.shape)
        if self.kind == "float":
            return f"{self.name} = {_randn(self.shape)}"
        if self.kind == "index":
            return f"{self.name} = torch.randint(0, {self.high}, {s}, generator=g)"
        if self.kind == "target":
            return (
                f"{self.name} = torch.randint(0, {self.high}, {s}, generator=g)"
                f".masked_fill(torch.rand({s}, generator=g) < 0.2, -100)"
            )
        return f"{self.name} = torch.rand({s}, generator=g) < 0.5"

    def meta(self) -> torch.Tensor:
        dtype = {"float": torch.float64, "mask": torch.bool}.get(self.kind, torch.int64)
        return torch.empty(self.shape, dtype=dtype, device="meta")


@dataclass
class Program:
    """Straight-line program: its inputs, body lines, returned values and the op kinds drawn."""

    inputs: list[Input]
    lines: list[str]
    outputs: list[str]
    out_shapes: list[tuple[int, ...]]
    ops: list[str]

    @property
    def floats(self) -> list[Input]:
        return [i for i in self.inputs if i.kind == "float"]

    @property
    def others(self) -> list[Input]:
        return [i for i in self.inputs if i.kind != "float"]

    def source(self) -> str:
        params = ", ".join(i.name for i in self.floats + self.others)
        body = "".join(f"    {line}\n" for line in self.lines)
        return f"def program({params}):\n{body}    return ({', '.join(self.outputs)},)\n"


_FORWARD_STEP = """
def step(floats, others, cots):
    return program(*floats, *others)
"""
_STEP = """
def step(floats, others, cots):
    def loss_fn(fl):
        return sum((o * c).sum() for o, c in zip(program(*fl, *others), cots))

    loss, grads = shardspec.value_and_grad(loss_fn)(floats)
    return program(*floats, *others), loss, grads
"""


@dataclass
class Case:
    """A program with a mesh, an input seed and specs for every input, output and (when ``grad``, the
    step returning outputs, loss and gradients) gradient; else the step returns the outputs only."""

    program: Program
    mesh: Mesh
    seed: int
    grad: bool
    in_specs: tuple[tuple[P, ...], tuple[P, ...], tuple[P, ...]]
    out_specs: Any

    def script(self) -> str:
        """A runnable script: define the program and step, build the inputs, compare sharded and eager."""
        prog = self.program
        mesh_axes = {a: self.mesh.shape[a] for a in self.mesh.axis_names}
        lines = [
            "import torch",
            "import torch.nn.functional as F",
            "import shardspec",
            "from shardspec import Mesh, P, sharded",
            "",
            prog.source(),
            (_STEP if self.grad else _FORWARD_STEP).strip("\n"),
            "",
            "",
            f"g = torch.Generator().manual_seed({self.seed})",
            *(i.code() for i in prog.inputs),
            f"cots = ({''.join(_randn(s) + ', ' for s in prog.out_shapes)})",
            f"floats = ({''.join(i.name + ', ' for i in prog.floats)})",
            f"others = ({''.join(i.name + ', ' for i in prog.others)})",
            f"mesh = Mesh({mesh_axes!r}, simulate=True)",
            f"in_specs = {_tuple_repr(self.in_specs)}",
            f"out_specs = {_tuple_repr(self.out_specs)}",
            "f = sharded(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs)",
        ]
        return "\n".join(lines) + "\n"

    def namespace(self) -> dict[str, Any]:
        """Execute ``script()`` (registered with linecache so traced lines point into it)."""
        src = self.script()
        name = f"<random_program_{next(_SCRIPT_IDS)}>"
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        ns: dict[str, Any] = {}
        exec(compile(src, name, "exec"), ns)
        return ns


def _randn(shape: tuple[int, ...]) -> str:
    return f"torch.randn({shape!r}, generator=g, dtype=torch.float64)"


def _tuple_repr(x: Any) -> str:
    if isinstance(x, tuple) and not isinstance(x, P):
        inner = ", ".join(_tuple_repr(e) for e in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    return repr(x)


class _Reject(Exception):
    """The drawn op does not fit (too large, rank too high); the builder rolls it back."""


class _Builder:
    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.inputs: list[Input] = []
        self.lines: list[str] = []
        self.ops: list[str] = []
        self.order: list[str] = []  # float values, oldest first
        self.meta: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()

    # -- values ---------------------------------------------------------------------------------------
    def dim(self, lo: int = 1, hi: int = 5) -> int:
        return self.draw(st.integers(lo, hi))

    def shape(self, lo_rank: int = 1, hi_rank: int = 3) -> tuple[int, ...]:
        return tuple(self.dim() for _ in range(self.draw(st.integers(lo_rank, hi_rank))))

    def input(self, shape: tuple[int, ...], kind: str = "float", high: int = 0) -> str:
        name = {"float": "x", "index": "i", "target": "t", "mask": "m"}[kind] + str(len(self.inputs))
        inp = Input(name, tuple(shape), kind, high)
        self.inputs.append(inp)
        self.meta[name] = inp.meta()
        if kind == "float":
            self.order.append(name)
        return name

    def pick(self, pred: Callable[[tuple[int, ...]], bool] = lambda s: len(s) >= 1) -> tuple[str, Shape]:
        """A float value satisfying ``pred``: usually the newest, sometimes any (values get reused)."""
        cands = [n for n in self.order if pred(tuple(self.meta[n].shape))]
        if not cands:
            raise _Reject
        name = cands[-1] if self.draw(st.integers(0, 2)) else self.draw(st.sampled_from(cands))
        self.used.add(name)
        return name, tuple(self.meta[name].shape)

    def emit(self, kind: str, expr: str) -> str:
        name = f"v{len(self.lines)}"
        env = {"torch": torch, "F": F, **self.meta}
        out = eval(expr, env)
        if out.dim() > MAX_RANK or out.numel() > MAX_NUMEL or out.numel() == 0:
            raise _Reject
        self.lines.append(f"{name} = {expr}")
        self.ops.append(kind)
        self.meta[name] = out
        self.order.append(name)
        return name

    def then_scalar(self, name: str) -> None:
        """Sometimes follow a contraction with a scalar op on its result (a pending sum's first user)."""
        if self.draw(st.integers(0, 2)) == 0:
            op_scalar(self, name)

    def try_op(self, gen: Callable[[_Builder], None]) -> bool:
        saved = (len(self.inputs), len(self.lines), len(self.ops), len(self.order), set(self.used))
        try:
            gen(self)
            return True
        except _Reject:
            ni, nl, no, nv, used = saved
            for i in self.inputs[ni:]:
                self.meta.pop(i.name)
            for n in self.order[nv:]:
                self.meta.pop(n, None)
            del self.inputs[ni:], self.lines[nl:], self.ops[no:], self.order[nv:]
            self.used = used
            return False

    def choice(self, xs: Any) -> Any:
        return self.draw(st.sampled_from(xs))

    def bool(self) -> bool:
        return self.draw(st.booleans())

    def axis(self, rank: int) -> int:
        """A dim of a rank-``rank`` value, sometimes written negative."""
        d = self.draw(st.integers(0, rank - 1))
        return d - rank if self.bool() else d


def _any(s: tuple[int, ...]) -> bool:
    return True


# -- op generators: each picks operands, may add inputs, and emits one line ------------------------------
def op_matmul(b: _Builder) -> None:
    h, s = b.pick(lambda s: len(s) >= 1)
    k, n = s[-1], b.dim()
    form = b.choice(["@", "linear", "linear_bias", "einsum", "self", "mm"])
    if form == "@":
        w = b.input((k, n))
        b.then_scalar(b.emit("matmul", f"{h} @ {w}"))
    elif form in ("linear", "linear_bias"):
        w = b.input((n, k))
        bias = f", {b.input((n,))}" if form == "linear_bias" else ""
        b.then_scalar(b.emit("linear", f"F.linear({h}, {w}{bias})"))
    elif form == "einsum":
        w = b.input((n, k))
        b.then_scalar(b.emit("einsum", f"torch.einsum('...k,nk->...n', {h}, {w})"))
    elif form == "self":
        if len(s) < 2:
            raise _Reject
        b.emit("matmul", f"torch.matmul({h}, {h}.mT)")
    else:
        if len(s) != 3:
            raise _Reject
        w = b.input((s[0], k, n))
        b.then_scalar(b.emit("bmm", f"torch.bmm({h}, {w})"))


def op_einsum(b: _Builder) -> None:
    """A random two-operand einsum: shared, contracted, batch and new letters."""
    h, s = b.pick(lambda s: len(s) >= 1)
    letters = "abcd"[: len(s)]
    shared = [c for c in letters if b.bool()] or [letters[-1]]
    new = ["y"] if b.bool() else []
    other = b.draw(st.permutations(shared + new))
    sizes = dict(zip(letters, s))
    sizes["y"] = b.dim()
    w = b.input(tuple(sizes[c] for c in other))
    pool = list(letters) + new
    out = [c for c in pool if b.bool()]
    out = list(b.draw(st.permutations(out)))
    b.then_scalar(b.emit("einsum", f"torch.einsum('{letters},{''.join(other)}->{''.join(out)}', {h}, {w})"))


def op_conv(b: _Builder) -> None:
    h, s = b.pick(lambda s: len(s) in (3, 4))
    spatial = s[2:]
    pad, stride = b.choice([0, 1]), b.choice([1, 2])
    ks = tuple(b.dim(1, min(3, n + 2 * pad)) for n in spatial)
    co = b.dim()
    w = b.input((co, s[1], *ks))
    bias = b.input((co,)) if b.bool() else "None"
    fn = "conv1d" if len(s) == 3 else "conv2d"
    b.emit(fn, f"F.{fn}({h}, {w}, {bias}, stride={stride}, padding={pad})")


def op_norm(b: _Builder) -> None:
    form = b.choice(["layer_norm", "layer_norm2", "rms", "rms_norm", "batch_norm", "group_norm"])
    if form in ("layer_norm", "layer_norm2"):
        nd = 1 if form == "layer_norm" else 2
        h, s = b.pick(lambda s: len(s) >= nd)
        ns = s[-nd:]
        wb = f", {b.input(ns)}, {b.input(ns)}" if b.bool() else ""
        b.emit("layer_norm", f"F.layer_norm({h}, {ns!r}{wb})")
    elif form == "rms":
        h, s = b.pick()
        w = b.input(s[-1:])
        b.emit("rms", f"{h} * torch.rsqrt({h}.pow(2).mean(-1, keepdim=True) + 1e-6) * {w}")
    elif form == "rms_norm":
        h, s = b.pick()
        b.emit("rms_norm", f"F.rms_norm({h}, {s[-1:]!r}, {b.input(s[-1:])}, eps=1e-6)")
    elif form == "batch_norm":
        h, s = b.pick(lambda s: 2 <= len(s) <= 4 and s[0] * math.prod(s[2:]) > 1)
        wb = f", {b.input(s[1:2])}, {b.input(s[1:2])}" if b.bool() else ""
        b.emit("batch_norm", f"F.batch_norm({h}, None, None{wb}, training=True)")
    else:
        h, s = b.pick(lambda s: 2 <= len(s) <= 4)
        ok = [g for g in range(1, s[1] + 1) if s[1] % g == 0 and s[1] // g * math.prod(s[2:]) > 1]
        if not ok:
            raise _Reject
        groups = b.choice(ok)
        wb = f", {b.input(s[1:2])}, {b.input(s[1:2])}" if b.bool() else ""
        b.emit("group_norm", f"F.group_norm({h}, {groups}{wb})")


def op_softmax(b: _Builder) -> None:
    h, s = b.pick()
    fn = b.choice(["softmax", "log_softmax"])
    b.emit(fn, f"torch.{fn}({h}, {b.axis(len(s))})")


def op_cross_entropy(b: _Builder) -> None:
    h, s = b.pick(lambda s: len(s) in (2, 3))
    t = b.input((s[0], *s[2:]), "target", high=s[1])
    red = b.choice(["mean", "sum"])
    ls = b.choice(["", ", label_smoothing=0.1"])
    b.emit("cross_entropy", f"F.cross_entropy({h}, {t}, reduction='{red}'{ls})")


def op_embedding(b: _Builder) -> None:
    if b.bool():
        w, s = b.pick(lambda s: len(s) == 2)
    else:
        s = (b.dim(), b.dim())
        w = b.input(s)
    idx = b.input(b.shape(1, 2), "index", high=s[0])
    b.emit("embedding", f"F.embedding({idx}, {w})")


def op_view(b: _Builder) -> None:
    form = b.choice(["merge", "split", "unsqueeze", "squeeze", "flatten", "expand"])
    if form == "merge":
        h, s = b.pick(lambda s: len(s) >= 2)
        d = b.draw(st.integers(0, len(s) - 2))
        new = (*s[:d], s[d] * s[d + 1], *s[d + 2 :])
        how = "view" if b.meta[h].is_contiguous() and b.bool() else "reshape"
        if b.bool():
            new = tuple(-1 if i == d else n for i, n in enumerate(new))
        b.emit(how, f"{h}.{how}{new!r}")
    elif form == "flatten":
        h, s = b.pick(lambda s: len(s) >= 2)
        d = b.draw(st.integers(0, len(s) - 2))
        b.emit("flatten", f"{h}.flatten({d}, {d + 1})")
    elif form == "split":
        h, s = b.pick(lambda s: len(s) < MAX_RANK and any(_divisors(n) for n in s))
        d = b.choice([i for i, n in enumerate(s) if _divisors(n)])
        a = b.choice(_divisors(s[d]))
        if b.bool():
            b.emit("unflatten", f"{h}.unflatten({d}, ({a}, {s[d] // a}))")
        else:
            how = "view" if b.meta[h].is_contiguous() and b.bool() else "reshape"
            b.emit(how, f"{h}.{how}{(*s[:d], a, s[d] // a, *s[d + 1 :])!r}")
    elif form == "unsqueeze":
        h, s = b.pick(lambda s: len(s) < MAX_RANK)
        b.emit("unsqueeze", f"{h}.unsqueeze({b.draw(st.integers(-len(s) - 1, len(s)))})")
    elif form == "squeeze":
        h, s = b.pick(lambda s: 1 in s)
        b.emit("squeeze", f"{h}.squeeze({b.choice([i for i, n in enumerate(s) if n == 1])})")
    else:
        h, s = b.pick(lambda s: len(s) < MAX_RANK)
        b.emit("expand", f"{h}.unsqueeze(0).expand({b.dim(2, 3)}, {', '.join(['-1'] * len(s))})")


def _divisors(n: int) -> list[int]:
    return [a for a in range(2, n) if n % a == 0]


def op_permute(b: _Builder) -> None:
    h, s = b.pick(lambda s: len(s) >= 2)
    form = b.choice(["permute", "transpose", "mT"])
    if form == "permute":
        b.emit("permute", f"{h}.permute{tuple(b.draw(st.permutations(range(len(s)))))!r}")
    elif form == "transpose":
        i, j = b.axis(len(s)), b.axis(len(s))
        b.emit("transpose", f"{h}.transpose({i}, {j})")
    else:
        b.emit("transpose", f"{h}.mT")


def op_cat(b: _Builder) -> None:
    h, s = b.pick()
    d = b.axis(len(s))
    form = b.choice(["self", "new", "existing"])
    if form == "self":
        parts = [h, h]
    elif form == "new":
        shape = list(s)
        shape[d] = b.dim()
        parts = [h, b.input(tuple(shape))]
    else:
        dd = d % len(s)

        def fits(t: tuple[int, ...]) -> bool:
            return len(t) == len(s) and all(a == c for i, (a, c) in enumerate(zip(t, s)) if i != dd)

        parts = [h, b.pick(fits)[0]]
    parts = list(b.draw(st.permutations(parts)))
    b.emit("cat", f"torch.cat([{', '.join(parts)}], {d})")


def op_split(b: _Builder) -> None:
    h, s = b.pick()
    d = b.axis(len(s))
    n = s[d]
    form = b.choice(["split", "chunk", "swap", "unbind"])
    if form == "split":
        k = b.dim(1, n)
        j = b.draw(st.integers(0, -(-n // k) - 1))
        b.emit("split", f"torch.split({h}, {k}, {d})[{j}]")
    elif form == "chunk":
        c = b.dim(1, 4)
        j = b.draw(st.integers(0, len(torch.empty(s, device="meta").chunk(c, d)) - 1))
        b.emit("chunk", f"{h}.chunk({c}, {d})[{j}]")
    elif form == "swap":
        b.emit("chunk", f"torch.cat({h}.chunk(2, {d})[::-1], {d})")
    else:
        b.emit("unbind", f"{h}.unbind({d})[{b.draw(st.integers(0, n - 1))}]")


def op_slice(b: _Builder) -> None:
    h, s = b.pick()
    d = b.draw(st.integers(0, len(s) - 1))
    n = s[d]
    form = b.choice(["slice", "neg", "step", "narrow", "select"])
    lead = ":, " * d
    if form == "slice":
        lo = b.draw(st.integers(0, n - 1))
        hi = b.draw(st.integers(lo + 1, n))
        b.emit("slice", f"{h}[{lead}{lo}:{hi}]")
    elif form == "neg":
        b.emit("slice", f"{h}[{lead}-{b.dim(1, n)}:]")
    elif form == "step":
        b.emit("slice", f"{h}[{lead}{b.draw(st.integers(0, n - 1))}::{b.dim(2, 3)}]")
    elif form == "narrow":
        lo = b.draw(st.integers(0, n - 1))
        b.emit("narrow", f"{h}.narrow({d}, {lo}, {b.dim(1, n - lo)})")
    else:
        i = b.draw(st.integers(-n, n - 1))
        b.emit("select", f"{h}[{lead}{i}]" if b.bool() else f"{h}.select({d}, {i})")


def op_index(b: _Builder) -> None:
    form = b.choice(["index", "index1", "gather", "index_select"])
    if form == "index":
        h, s = b.pick()
        i = b.input(b.shape(1, 2), "index", high=s[0])
        b.emit("index", f"{h}[{i}]")
    elif form == "index1":
        h, s = b.pick(lambda s: len(s) >= 2)
        i = b.input((b.dim(),), "index", high=s[1])
        b.emit("index", f"{h}[:, {i}]")
    elif form == "gather":
        h, s = b.pick()
        d = b.axis(len(s))
        shape = tuple(b.dim() if i == d % len(s) else b.dim(1, n) for i, n in enumerate(s))
        i = b.input(shape, "index", high=s[d])
        b.emit("gather", f"torch.gather({h}, {d}, {i})")
    else:
        h, s = b.pick()
        d = b.axis(len(s))
        i = b.input((b.dim(),), "index", high=s[d])
        b.emit("index_select", f"torch.index_select({h}, {d}, {i})")


def op_reduce(b: _Builder) -> None:
    h, s = b.pick()
    d = b.axis(len(s))
    keep = b.bool()
    form = b.choice(["sum", "mean", "amax", "max", "var", "logsumexp", "all", "multi"])
    if form in ("sum", "mean", "amax"):
        b.emit(form, f"{h}.{form}({d}, keepdim={keep})")
    elif form == "max":
        b.emit("max", f"{h}.max({d}, keepdim={keep}).values")
    elif form == "var":
        if s[d] < 2:
            raise _Reject
        b.emit("var", f"{h}.var({d}, keepdim={keep})")
    elif form == "logsumexp":
        b.emit("logsumexp", f"torch.logsumexp({h}, {d}, keepdim={keep})")
    elif form == "all":
        b.emit("sum", f"{h}.{b.choice(['sum', 'mean'])}()")
    else:
        if len(s) < 2:
            raise _Reject
        dims = tuple(sorted(b.draw(st.permutations(range(len(s))))[:2]))
        b.emit("sum", f"{h}.{b.choice(['sum', 'mean'])}({dims!r}, keepdim={keep})")


def op_scalar(b: _Builder, h: str | None = None) -> None:
    """A Python scalar on either side of ``h`` (default: a picked value)."""
    if h is None:
        h, _ = b.pick(_any)
    else:
        b.used.add(h)
    c = b.choice(SCALARS)
    form = b.choice(["c-h", "h/c", "c**h", "h-c", "c*h", "h+c", "c/h", "h**2", "-h", "h*c+c"])
    expr = {
        "c-h": f"{c} - {h}",
        "h/c": f"{h} / {c}",
        "c**h": f"{abs(c)} ** {h}",
        "h-c": f"{h} - {c}",
        "c*h": f"{c} * {h}",
        "h+c": f"{h} + {c}",
        "c/h": f"{c} / (1.0 + {h} * {h})",
        "h**2": f"{h} ** 2",
        "-h": f"-{h}",
        "h*c+c": f"{h} * {c} + {b.choice(SCALARS)}",
    }[form]
    b.emit("scalar " + form, expr)


def _broadcast_shape(b: _Builder, s: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts against ``s``: a suffix of it with some dims set to 1."""
    t = s[b.draw(st.integers(0, len(s))) :]
    return tuple(1 if b.bool() and b.bool() else n for n in t)


def op_binary(b: _Builder) -> None:
    h, s = b.pick(_any)
    form = b.choice(["bcast", "same", "self", "bigger"])
    if form == "bcast":
        y = b.input(_broadcast_shape(b, s))
    elif form == "same":
        y = b.pick(lambda t: t == s)[0]
    elif form == "self":
        y = h
    else:
        if len(s) >= MAX_RANK:
            raise _Reject
        y = b.input((b.dim(2, 3), *s))
    a, c = (h, y) if b.bool() else (y, h)
    op = b.choice(["+", "-", "*", "/", "max"])
    if op == "max":
        b.emit("maximum", f"torch.maximum({a}, {c})")
    elif op == "/":
        b.emit("div", f"{a} / (1.0 + {c} * {c})")
    else:
        b.emit(f"binary {op}", f"{a} {op} {c}")


def op_unary(b: _Builder) -> None:
    h, s = b.pick(_any)
    fn = b.choice(
        ["torch.tanh", "torch.sigmoid", "F.gelu", "F.silu", "torch.sin", "torch.relu", "torch.exp", "tril"]
    )
    if fn == "torch.exp":
        b.emit("exp", f"torch.exp(torch.tanh({h}))")
    elif fn == "tril":
        if len(s) < 2:
            raise _Reject
        b.emit("tril", f"{h}.{b.choice(['tril', 'triu'])}({b.draw(st.integers(-1, 1))})")
    else:
        b.emit(fn.split(".")[1], f"{fn}({h})")


def op_where(b: _Builder) -> None:
    h, s = b.pick()
    form = b.choice(["where", "where_scalar", "masked_fill", "where_cmp"])
    if form == "where_cmp":
        b.emit("where", f"torch.where({h} > 0.25, {h}, {b.choice(SCALARS)} * {h})")
        return
    m = b.input(_broadcast_shape(b, s), "mask")
    if form == "where":
        y = b.pick(lambda t: t == s)[0] if b.bool() else b.input(_broadcast_shape(b, s))
        b.emit("where", f"torch.where({m}, {h}, {y})")
    elif form == "where_scalar":
        b.emit("where", f"torch.where({m}, {b.choice(SCALARS)}, {h})")
    else:
        b.emit("masked_fill", f"{h}.masked_fill({m}, {b.choice(SCALARS)})")


def op_cumsum(b: _Builder) -> None:
    h, s = b.pick()
    d = b.axis(len(s))
    b.emit("cumsum", f"torch.cumsum({h}, {d})" if b.bool() else f"{h}.cumsum({d})")


def op_attention(b: _Builder) -> None:
    h, s = b.pick(lambda s: len(s) in (3, 4))
    causal = b.bool()
    if b.bool():
        b.emit("sdpa", f"F.scaled_dot_product_attention({h}, {h}, {h}, is_causal={causal})")
        return
    t, dv = b.dim(), b.dim()
    k = b.input((*s[:-2], t, s[-1]))
    v = b.input((*s[:-2], t, dv))
    b.emit("sdpa", f"F.scaled_dot_product_attention({h}, {k}, {v}, is_causal={causal})")


def op_more(b: _Builder) -> None:
    """Less common structural ops: stack, pad, flip, roll, repeat, addmm, normalize, losses, scatters."""
    form = b.choice(
        [
            "stack",
            "pad",
            "flip",
            "roll",
            "repeat",
            "addmm",
            "normalize",
            "mse",
            "index_add",
            "scatter_add",
            "topk",
        ]
    )
    if form == "addmm":
        h, s = b.pick(lambda s: len(s) == 2)
        n = b.dim()
        b.emit("addmm", f"torch.addmm({b.input((n,))}, {h}, {b.input((s[1], n))})")
        return
    if form == "mse":
        h, s = b.pick()
        b.emit("mse_loss", f"F.mse_loss({h}, {b.input(s)}, reduction='{b.choice(['mean', 'sum'])}')")
        return
    h, s = b.pick()
    d = b.axis(len(s))
    if form == "stack":
        if len(s) >= MAX_RANK:
            raise _Reject
        y = b.pick(lambda t: t == s)[0] if b.bool() else b.input(s)
        b.emit("stack", f"torch.stack([{h}, {y}], {b.draw(st.integers(-len(s) - 1, len(s)))})")
    elif form == "pad":
        pads = tuple(b.draw(st.integers(0, 2)) for _ in range(2 * b.draw(st.integers(1, min(2, len(s))))))
        b.emit("pad", f"F.pad({h}, {pads!r}, value={b.choice(SCALARS)})")
    elif form == "flip":
        b.emit("flip", f"{h}.flip({d})")
    elif form == "roll":
        b.emit("roll", f"{h}.roll({b.draw(st.integers(-3, 3))}, {d})")
    elif form == "repeat":
        reps = tuple(b.dim(1, 2) for _ in s)
        b.emit("repeat", f"{h}.repeat{reps!r}")
    elif form == "normalize":
        b.emit("normalize", f"F.normalize({h}, dim={d})")
    elif form == "index_add":
        i = b.input((b.dim(),), "index", high=s[d])
        src = tuple(i_n if k != d % len(s) else b.meta[i].shape[0] for k, i_n in enumerate(s))
        b.emit("index_add", f"{h}.index_add({d}, {i}, {b.input(src)})")
    elif form == "scatter_add":
        shape = tuple(b.dim(1, n) for n in s)
        i = b.input(shape, "index", high=s[d])
        b.emit("scatter_add", f"{h}.scatter_add({d}, {i}, {b.input(shape)})")
    else:
        b.emit("topk", f"{h}.topk({b.dim(1, s[d])}, {d}).values")


OPS: tuple[Callable[[_Builder], None], ...] = (  # repeats weight the draw
    op_matmul,
    op_matmul,
    op_matmul,
    op_einsum,
    op_einsum,
    op_norm,
    op_scalar,
    op_scalar,
    op_scalar,
    op_scalar,
    op_more,
    op_more,
    op_binary,
    op_reduce,
    op_view,
    op_conv,
    op_norm,
    op_softmax,
    op_cross_entropy,
    op_embedding,
    op_view,
    op_permute,
    op_cat,
    op_split,
    op_slice,
    op_index,
    op_reduce,
    op_scalar,
    op_binary,
    op_unary,
    op_where,
    op_cumsum,
    op_attention,
)


@st.composite
def programs(draw: st.DrawFn, min_ops: int = 2, max_ops: int = 6) -> Program:
    """A straight-line program of ``min_ops..max_ops`` ops over one or two float64 inputs."""
    b = _Builder(draw)
    for _ in range(draw(st.integers(1, 2))):
        b.input(b.shape(1, 4))
    want = draw(st.integers(min_ops, max_ops))
    tries = 0
    while len(b.lines) < want and tries < 4 * want:
        tries += 1
        b.try_op(draw(st.sampled_from(OPS)))
    if len(b.lines) < min_ops:
        b.try_op(op_scalar)
    computed = [n for n in b.order if n.startswith("v")]
    outputs = [n for n in computed if n not in b.used] or computed[-1:]
    return Program(b.inputs, b.lines, outputs, [tuple(b.meta[n].shape) for n in outputs], b.ops)


@st.composite
def cases(draw: st.DrawFn, max_ops: int = 6) -> Case:
    """A program with a mesh (1-3 axes of 1-4 devices) and random specs for inputs, outputs, gradients.

    Specs are correlated the way real ones are: a dim size picks a favourite mesh entry that dims of
    that size take three times in four (so a contraction is often split on both operands, or two operands of
    an elementwise op share a layout), else each dim draws its own.
    """
    mesh = draw(meshes(max_devices=8, max_axes=3), label="mesh")
    prog = draw(programs(max_ops=max_ops), label="program")
    favourite: dict[int, P] = {}

    def spec_for(shape: tuple[int, ...]) -> P:
        own = draw(specs(mesh, len(shape)))
        entries: list[Any] = []
        taken: set[str] = set()
        for n, e in zip(shape, tuple(own) + (None,) * len(shape)):
            if n not in favourite:
                favourite[n] = draw(specs(mesh, 1))
            fav = favourite[n][0] if len(favourite[n]) else None
            pick = fav if draw(st.integers(0, 3)) else e
            names = () if pick is None else (pick,) if isinstance(pick, str) else tuple(pick)
            if taken & set(names):
                pick, names = None, ()
            taken |= set(names)
            entries.append(pick)
        return P(*entries)

    float_specs = tuple(spec_for(i.shape) for i in prog.floats)
    other_specs = tuple(spec_for(i.shape) for i in prog.others)
    cot_specs = tuple(spec_for(s) for s in prog.out_shapes)
    out_specs = tuple(spec_for(s) for s in prog.out_shapes)
    grad = draw(st.integers(0, 3), label="grad") > 0
    seed = draw(st.integers(0, 2**16), label="seed")
    if grad:
        full_out: Any = (out_specs, P(), tuple(spec_for(i.shape) for i in prog.floats))
    else:
        full_out = out_specs
    return Case(prog, mesh, seed, grad, (float_specs, other_specs, cot_specs), full_out)
