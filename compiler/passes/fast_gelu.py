"""Fast GELU: the eager runtime computes tanh-approximate GELU on the CPU as ``x * sigmoid(2y)``.

Why: ``0.5 x (1 + tanh(y))`` with ``y = sqrt(2/pi) (x + 0.044715 x^3)`` equals ``x * sigmoid(2y)``
(``sigmoid(2y) = (1 + tanh(y)) / 2``), and ATen's CPU tanh is slow: its GELU kernel takes about
440 µs on a 256 x 1024 fp32 activation, five vectorized passes of the sigmoid form about 190 µs (one
GELU per GPT layer: about 1 ms of a 4-layer step). The sigmoid form is also the more accurate: it
has no ``1 + tanh`` cancellation, which leaves ATen's result for negative inputs with up to 100%
relative error (its absolute error is about the same, 5e-7).

The passes write into the result's own buffer (no temporary), so the memory the planner predicts is
unchanged. Only ``gelu(x, approximate="tanh")`` on CPU fp32/fp64 tensors is replaced; an output
that overlaps the input (where the sigmoid form would read what it already overwrote) keeps ATen's
kernel. The backward keeps ATen's ``gelu_backward``: a sigmoid form of it is faster only with
cancellation that loses up to 16 ulps near x = 5.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import copy_module

aten = torch.ops.aten
TWO_C = 2 * math.sqrt(2 / math.pi)
KAPPA = 0.044715


def gelu_tanh(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``aten.gelu(x, approximate="tanh")`` on the CPU, into ``out`` when given."""
    # The planner's values are all CPU fakes, so the device is decided here, per call.
    if x.device.type != "cpu" and out is None:
        return torch.nn.functional.gelu(x, approximate="tanh")
    if out is None:
        out = torch.empty_like(x)
    elif x.device.type != "cpu" or _overlap(x, out):
        torch.ops.aten.gelu.out(x, approximate="tanh", out=out)
        return out
    torch.mul(x, x, out=out)
    torch.addcmul(x, out, x, value=KAPPA, out=out)  # x + k x^3
    out.mul_(TWO_C).sigmoid_()
    return out.mul_(x)


def fast_gelu(gm: GraphModule) -> GraphModule:
    """``gm`` with its CPU tanh-approximate GELUs computed by ``gelu_tanh``; ``gm`` itself when it
    has none."""
    if not any(_replaceable(n) for n in gm.graph.nodes):
        return gm
    new = copy_module(gm)
    for node in list(new.graph.nodes):
        if _replaceable(node):
            node.target = gelu_tanh
            node.kwargs = {k: v for k, v in node.kwargs.items() if k == "out"}
    new.graph.lint()
    new.recompile()
    return new


def _replaceable(n: Node) -> bool:
    if n.op != "call_function" or n.target not in (aten.gelu.default, aten.gelu.out):
        return False
    if len(n.args) != 1 or n.kwargs.get("approximate") != "tanh":
        return False
    val = n.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and val.device.type == "cpu"
        and val.dtype in (torch.float32, torch.float64)
        and set(n.kwargs) <= {"approximate", "out"}
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a`` and ``b`` span intersect (the same storage, overlapping ranges)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    return lo_a < lo_b + _extent(b) and lo_b < lo_a + _extent(a)


def _extent(t: torch.Tensor) -> int:
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()
