"""Training steps whose backward ops once had no rule (or crashed the replicated fallback), and
constants meeting a pending sum (once a wrong answer): each compiles by default and matches the
unsharded loss and gradients over a few meshes and specs."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F

from compiler.rules import registry
from shardspec import Mesh, P, ShardingError, sharded, value_and_grad

MESHES = {"dp2": Mesh({"dp": 2}, simulate=True), "dp2xtp2": Mesh({"dp": 2, "tp": 2}, simulate=True)}


def _check(fn: Callable[..., torch.Tensor], args: tuple[Any, ...], specs: tuple[P, ...], mesh: Mesh) -> None:
    vg = value_and_grad(fn, argnums=0)
    step = sharded(vg, mesh=mesh, in_specs=specs, out_specs=(P(), specs[0]))
    got, want = step(*args), vg(*args)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _conv1d(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = F.conv1d(x, w, b, padding=1)
    return F.conv1d(h.relu(), w.transpose(0, 1).contiguous(), padding=1).square().mean()


def _conv2d(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.conv2d(F.conv2d(x, w, padding=1).tanh(), w[:, :4].transpose(0, 1).contiguous()).square().sum()


def _gen(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64)


CONV = [
    ("conv1d", _conv1d, (_gen(4, 4, 3), _gen(4, 4, 8), _gen(4))),
    ("conv2d", _conv2d, (_gen(4, 4, 3, 3), _gen(4, 4, 6, 6))),
]


@pytest.mark.parametrize("mesh", list(MESHES), ids=str)
@pytest.mark.parametrize("case", CONV, ids=lambda c: c[0])
def test_conv_training_step_compiles_by_default(case: Any, mesh: str) -> None:
    """convolution_backward: batch split (data parallel) and the channels split over tp."""
    _, fn, args = case
    m = MESHES[mesh]
    tp = "tp" if "tp" in m.axis_names else None
    wspec = P(None, tp)  # input channels of the weight split: a pending sum in forward
    rest = tuple(P() for _ in args[2:])
    _check(fn, args, (P(), P("dp"), *rest), m)
    _check(fn, args, (wspec, P("dp", tp), *rest), m)


def test_conv1d_backward_falls_back_to_replicated_without_its_rule(monkeypatch: Any) -> None:
    """unsupported='replicate' once crashed on convolution_backward's unrequested (None) results."""
    monkeypatch.delitem(registry.REGISTRY, torch.ops.aten.convolution_backward.default)
    fn, args = CONV[0][1], CONV[0][2]
    vg = value_and_grad(fn, argnums=(0, 1))
    specs = (P(), P("dp"), P())
    step = sharded(
        vg, mesh=MESHES["dp2"], in_specs=specs, out_specs=(P(), specs[:2]), unsupported="replicate"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = step(*args)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(vg(*args)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _index_select(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return (t.index_select(0, i).sin() + t.index_select(1, i % 4).cos().sum(1, keepdim=True)).sum()


def _diagonal(m: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(m, dim1=1, dim2=2).square().sum() + torch.diagonal(m, 1, 0, 2).exp().sum()


def _avg_pool(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x.sin(), 2).square().sum() + F.avg_pool2d(x, 3, 1, 1).exp().mean()


def _one_hot(w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (F.log_softmax(w[labels % 6], -1) * F.one_hot(labels % 5, 5)).sum()


INDEX = torch.tensor([0, 2, 2, 5, 1, 4])
OTHER = [
    ("index_select", _index_select, _gen(6, 4), [P(), P(None, "dp"), P("dp", "tp")]),
    ("diagonal", _diagonal, _gen(4, 5, 5), [P("dp"), P(("dp", "tp"))]),
    ("avg_pool2d", _avg_pool, _gen(4, 4, 6, 6), [P("dp"), P("dp", "tp")]),
    ("one_hot", _one_hot, _gen(6, 5), [P(), P("dp"), P(None, "tp")]),
]


@pytest.mark.parametrize("mesh", list(MESHES), ids=str)
@pytest.mark.parametrize("case", OTHER, ids=lambda c: c[0])
def test_backward_of_indexing_diagonal_pooling_and_one_hot(case: Any, mesh: str) -> None:
    _, fn, x, xspecs = case
    m = MESHES[mesh]
    for spec in xspecs:
        if any(a not in m.axis_names for e in spec for a in ((e,) if isinstance(e, str) else e or ())):
            continue
        _check(fn, (x, INDEX), (spec, P("dp") if spec == P() else P()), m)


def test_one_hot_without_num_classes_names_the_line() -> None:
    def fn(w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (w * F.one_hot(labels)).sum()

    step = sharded(value_and_grad(fn), mesh=MESHES["dp2"], in_specs=(P(), P("dp")), out_specs=(P(), P()))
    with pytest.raises(
        ShardingError, match=r"(?s)one_hot without num_classes at .*test_backward_rules.*num_classes="
    ):
        step(torch.randn(4, 6), torch.tensor([0, 5, 1, 2]))


@pytest.mark.parametrize("label", [6, -1])
def test_one_hot_of_a_label_out_of_range_is_eagers_error(label: int) -> None:
    """The range check F.one_hot makes on its labels' values runs in the program (on each device's
    own labels): an out-of-range label raises as in eager, not a silent row of zeros."""

    def fn(labels: torch.Tensor) -> torch.Tensor:
        return F.one_hot(labels, 6)

    step = sharded(fn, mesh=MESHES["dp2"], in_specs=(P("dp"),), out_specs=P("dp"))
    good = torch.tensor([0, 5, 1, 2])
    assert torch.equal(step(good), fn(good))
    bad = torch.tensor([0, 5, 1, label])
    with pytest.raises(RuntimeError) as eager:
        fn(bad)
    with pytest.raises(RuntimeError, match=re.escape(str(eager.value))):
        step(bad)


def _constant_losses() -> list[Callable[..., torch.Tensor]]:
    F = torch.nn.functional

    def one_minus(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (1.0 - x @ w).square().sum()

    def plus_scalar(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ((x @ w + 2.0) * 3.0).square().mean()

    def rsub(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.rsub(x @ w, 0.5).abs().sum()

    def constant_tensor(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.tensor(1.5) - x @ w).square().sum()

    def reciprocal(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (1.0 / (x @ w).square().add(1.0)).sum()

    def cosine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (1.0 - F.cosine_similarity(x @ w, x @ w.flip(0), dim=-1)).mean()

    return [one_minus, plus_scalar, rsub, constant_tensor, reciprocal, cosine]


@pytest.mark.parametrize("fn", _constant_losses(), ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "axes, xspec, wspec",
    [
        ({"tp": 2}, P(None, "tp"), P("tp", None)),
        ({"dp": 2, "tp": 2}, P("dp", "tp"), P("tp", None)),
    ],
    ids=["tp2", "dp2xtp2"],
)
def test_constant_meets_a_split_contraction(fn: Any, axes: dict[str, int], xspec: P, wspec: P) -> None:
    """A scalar or constant combined with a pending sum (``1.0 - x @ w`` with the contraction split)
    once added the constant on every device: the answer was off by (devices - 1) * constant."""
    mesh = Mesh(axes, simulate=True)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 6, generator=g), torch.randn(6, 3, generator=g)
    f = sharded(fn, mesh=mesh, in_specs=(xspec, wspec), out_specs=P())
    torch.testing.assert_close(f(x, w), fn(x, w))
    vg = value_and_grad(fn, argnums=(0, 1))
    sg = sharded(vg, mesh=mesh, in_specs=(xspec, wspec), out_specs=(P(), (xspec, wspec)))
    got, want = sg(x, w), vg(x, w)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_index_add_onto_a_nonzero_base_with_a_split_index() -> None:
    """index_put(accumulate) onto a nonzero base with the index split once added the base per device."""

    def fn(v: torch.Tensor, base: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return base.index_add(0, i, v.sin()).square().sum()

    v, base = _gen(6, 3), _gen(4, 3)
    _check(fn, (v, base, INDEX % 4), (P("dp"), P(), P("dp")), MESHES["dp2"])


def test_conv_bias_gradient_with_split_input_channels() -> None:
    """convolution_backward asked for grad_bias alone does not depend on the input channels: a
    split there once summed one full copy per device."""

    def fn(b: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, w, b, padding=1).square().sum()

    args = (_gen(5), _gen(5, 4, 3, 3), _gen(4, 4, 5, 5))
    _check(fn, args, (P(), P(None, "tp"), P("dp", "tp")), MESHES["dp2xtp2"])
