"""The eager runtime's program calls tensor methods and torch functions instead of ATen overloads
(compiler/passes/fast_calls.py): the same bits, the same views (shape, strides, offset, storage),
and every rewritable overload rewritten."""

from __future__ import annotations

import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from compiler.passes.fast_calls import FUNCTIONS, METHODS, fast_calls

aten = torch.ops.aten


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().data_ptr())


def _step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h = torch.addmm(b, x.reshape(-1, 8), w.t())  # addmm, reshape, t
    q, k = h.view(2, 3, 2, 4).unbind(2)  # view, unbind
    s = torch.mm(q.reshape(6, 4), k.reshape(6, 4).transpose(0, 1))  # mm, transpose
    e = s.unsqueeze(0).expand(2, 6, 6).permute(1, 0, 2).contiguous()  # unsqueeze, expand, permute
    parts = e.split([1, 5], 0)  # split_with_sizes
    sl = h[1:5, ::2] + h[:4, 1::2]  # slices, add
    out = torch.empty(6, 6)
    out.copy_(s.select(0, 1).squeeze(0))  # copy_, select, squeeze
    return e, parts[1], sl, out, torch.bmm(e, e.transpose(1, 2))


def test_same_bits_and_views_as_the_overloads() -> None:
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, generator=g))
    gm = make_fx(_step)(*args)
    fast = fast_calls(gm)
    left = {n.target for n in fast.graph.nodes if n.op == "call_function"}
    assert not left & (set(METHODS) | set(FUNCTIONS) | {aten.slice.Tensor}), left
    assert any(n.op == "call_method" for n in fast.graph.nodes)
    want, got = gm(*args), fast(*args)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
        assert a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def test_out_and_scalar_keywords_reach_the_same_overload() -> None:
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(4, 4, generator=g) for _ in range(3))

    def f(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        buf = torch.empty(4, 4)
        m = aten.mm.out(a, b, out=buf)
        n = aten.addmm.out(c, a, b, beta=0.5, alpha=2.0, out=torch.empty(4, 4))
        return m, n, aten.add.Tensor(m, n, alpha=3), aten.add.Tensor(a, 2.5)

    gm = make_fx(f)(a, b, c)
    fast = fast_calls(gm)
    assert not {n.target for n in fast.graph.nodes} & set(FUNCTIONS)
    for x, y in zip(gm(a, b, c), fast(a, b, c), strict=True):
        assert torch.equal(x, y)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
)
def test_a_slice_is_the_same_view_as_basic_indexing(shape: list[int], data: st.DataObject) -> None:
    """``aten.slice.Tensor`` clamps and wraps its bounds as Python slicing does, for any bounds."""
    dim = data.draw(st.integers(0, len(shape) - 1))
    start = data.draw(st.none() | st.integers(-7, 7) | st.just(-(2**63)))
    end = data.draw(st.none() | st.integers(-7, 7) | st.just(2**63 - 1) | st.just(-(2**63)))
    step = data.draw(st.integers(1, 3))
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    gm = make_fx(lambda t: aten.slice.Tensor(t, dim, start, end, step))(x)
    fast = fast_calls(gm)
    assert aten.slice.Tensor not in {n.target for n in fast.graph.nodes}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # indexing warns for bounds near int64's minimum
        want, got = gm(x), fast(x)
    assert torch.equal(want, got) and _layout(want) == _layout(got)


def test_a_program_with_nothing_to_rewrite_is_returned_as_it_is() -> None:
    gm = make_fx(lambda t: aten.sin.default(t))(torch.ones(2))
    assert fast_calls(gm) is gm
