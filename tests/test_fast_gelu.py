"""Tanh-approximate GELU on the CPU as ``x * sigmoid(2y)`` (compiler/passes/fast_gelu.py): within
ATen's absolute error of the exact float64 value and far better in relative terms, into the given
buffer without a temporary, ATen's kernel where the output overlaps the input, and only the
tanh-approximate CPU float GELUs replaced."""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compiler.passes.fast_gelu import fast_gelu, gelu_tanh
from compiler.passes.graph import annotate

aten = torch.ops.aten


def _exact(x: torch.Tensor) -> torch.Tensor:
    """The fp32 input's GELU in float64, in the form without cancellation (about 1e-16 relative)."""
    d = x.double()
    return d * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (d + 0.044715 * d**3))


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(1 << 16, generator=g) * s for s in (0.5, 1.0, 3.0, 10.0)]
    return torch.cat([*parts, torch.linspace(-20, 20, 1 << 14)]).to(dtype)


def test_as_accurate_as_aten_absolutely_and_better_relatively() -> None:
    x = _inputs(torch.float32)
    want = _exact(x)
    ours, aten_ = gelu_tanh(x).double(), aten.gelu(x, approximate="tanh").double()
    eps = torch.finfo(torch.float32).eps
    assert (ours - want).abs().max() <= max(2 * (aten_ - want).abs().max().item(), 8 * eps)
    moderate = x.abs() < 6  # where the result is not vanishingly small
    rel = ((ours - want).abs() / want.abs().clamp_min(1e-300))[moderate]
    assert rel.max() < 64 * eps  # ATen's reaches 1.0 here (1 + tanh cancels for negative x)
    assert ((aten_ - want).abs() / want.abs().clamp_min(1e-300))[moderate].max() > 0.5


def test_float64_agrees_with_aten_to_its_precision() -> None:
    x = _inputs(torch.float64)
    ours, aten_ = gelu_tanh(x), aten.gelu(x, approximate="tanh")
    torch.testing.assert_close(ours, aten_, rtol=0, atol=1e-14)


def test_writes_into_the_given_buffer_and_falls_back_where_it_overlaps_the_input() -> None:
    x = _inputs(torch.float32)
    out = torch.empty_like(x)
    assert gelu_tanh(x, out=out) is out
    torch.testing.assert_close(out.double(), _exact(x), rtol=0, atol=1e-6)
    shared = x.clone()
    got = gelu_tanh(shared, out=shared)  # in place: ATen's kernel, not the overwriting passes
    assert torch.equal(got, aten.gelu(x, approximate="tanh"))


def test_only_tanh_gelus_on_cpu_floats_are_replaced() -> None:
    def f(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.nn.functional.gelu(x, approximate="tanh"),
            torch.nn.functional.gelu(x),
            torch.nn.functional.gelu(x.to(torch.bfloat16), approximate="tanh"),
            i,
        )

    x = torch.randn(64)
    gm = make_fx(f)(x, torch.arange(3))
    annotate(gm, [((64,), torch.float32), ((3,), torch.int64)])
    fast = fast_gelu(gm)
    targets = [n.target for n in fast.graph.nodes if n.op == "call_function"]
    assert targets.count(gelu_tanh) == 1 and targets.count(aten.gelu.default) == 2
    got = fast(x, torch.arange(3))
    torch.testing.assert_close(got[0].double(), _exact(x), rtol=0, atol=1e-6)
    assert torch.equal(got[1], torch.nn.functional.gelu(x))
