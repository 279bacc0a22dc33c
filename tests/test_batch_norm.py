"""Batch norm's running statistics: written in place by the kernel although its schema does not say
so. Trained the functional way (copies in, updated copies out) they equal eager's under any split;
written into an argument or a closed-over tensor they are errors naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import shardspec
from shardspec import Mesh, P, ShardingError, sharded

MESHES = {
    "dp": Mesh({"dp": 2}, simulate=True),
    "tp": Mesh({"tp": 2}, simulate=True),
    "dp_tp": Mesh({"dp": 2, "tp": 2}, simulate=True),
}


def _bn(x: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    rm, rv = rm.clone(), rv.clone()
    return F.batch_norm(x, rm, rv, training=True, momentum=0.1), rm, rv


@pytest.mark.parametrize(
    "mesh, x_spec, stat_spec, shape",
    [
        ("dp", P("dp"), P(), (8, 4)),
        ("tp", P(None, "tp"), P(), (8, 4)),
        ("tp", P(None, "tp"), P("tp"), (8, 4)),
        ("dp_tp", P("dp", "tp"), P(), (8, 4)),
        ("dp_tp", P("dp", "tp"), P("tp"), (8, 4, 3, 3)),  # BatchNorm2d's layout
    ],
)
def test_running_statistics_equal_eager_under_every_split(
    mesh: str, x_spec: P, stat_spec: P, shape: tuple[int, ...]
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3 + 1
    rm, rv = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    step = sharded(
        _bn,
        mesh=MESHES[mesh],
        in_specs=(x_spec, stat_spec, stat_spec),
        out_specs=(x_spec, stat_spec, stat_spec),
    )
    got = step(x, rm, rv)
    want = _bn(x, rm, rv)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(want[1], rm) and not torch.equal(want[2], rv)  # they were updated


def test_a_module_trained_through_functional_call_with_zero3_params() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    def loss_fn(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, (p, b), (x,)).square().mean()

    def step(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor) -> tuple:
        b = {k: v.clone() for k, v in b.items()}
        loss, grads = shardspec.value_and_grad(loss_fn)(p, b, x)
        return loss, grads, b

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    pspec = {k: P("dp") if v.shape[0] % 2 == 0 else P() for k, v in params.items()}
    f = sharded(
        step,
        mesh=MESHES["dp"],
        in_specs=(pspec, P(), P("dp")),
        out_specs=(P(), pspec, P()),
    )
    loss, grads, new = f(params, buffers, x)
    want_b = {k: v.clone() for k, v in buffers.items()}
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    want_loss = functional_call(model, (p, want_b), (x,)).square().mean()
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss.detach())
    for k in params:
        torch.testing.assert_close(grads[k], p[k].grad)
    for k in buffers:
        torch.testing.assert_close(new[k], want_b[k])


def test_eval_mode_and_batch_statistics_alone_stay_the_fused_kernel() -> None:
    x, rm, rv = torch.randn(8, 4), torch.randn(4), torch.rand(4) + 0.5

    def ev(x: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, rm, rv, training=False)

    def stats_free(x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, None, None, training=True)

    for spec in (P("dp"), P(None, "dp")):
        f = sharded(ev, mesh=MESHES["dp"], in_specs=(spec, P(), P()), out_specs=spec)
        torch.testing.assert_close(f(x, rm, rv), ev(x, rm, rv))
        ops = {str(n.target) for n in f.lower(x, rm, rv).program.traced.module.graph.nodes}
        assert "aten.native_batch_norm.default" in ops and "aten.copy_.default" not in ops
        g = sharded(stats_free, mesh=MESHES["dp"], in_specs=(spec,), out_specs=spec)
        torch.testing.assert_close(g(x), stats_free(x))


def test_running_statistics_written_into_an_argument_name_it_and_the_line() -> None:
    def f(x: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, rm, rv, training=True)

    step = sharded(f, mesh=MESHES["dp"], in_specs=(P("dp"), P(), P()), out_specs=P("dp"))
    with pytest.raises(ShardingError, match=r"(?s)rm is modified in place at .*test_batch_norm.py.*clone"):
        step(torch.randn(8, 4), torch.zeros(4), torch.ones(4))


RM = torch.zeros(4)
RV = torch.ones(4)


def test_running_statistics_closed_over_are_named() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, RM, RV, training=True)

    step = sharded(f, mesh=MESHES["dp"], in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(ShardingError, match=r"closes over \(RM, shape \(4,\)\)"):
        step(torch.randn(8, 4))
    assert torch.equal(RM, torch.zeros(4))  # and nothing was written to it


def test_out_tuple_into_closed_over_tensors_is_refused() -> None:
    values, indices = torch.zeros(4), torch.zeros(4, dtype=torch.long)

    def f(x: torch.Tensor) -> torch.Tensor:
        torch.max(x, 0, out=(values, indices))
        return x * 2

    step = sharded(f, mesh=MESHES["dp"], in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(ShardingError, match=r"closes over \(values, shape \(4,\)\)"):
        step(torch.randn(8, 4))


def test_half_precision_input_updates_fp32_statistics_from_an_fp32_variance() -> None:
    x = torch.randn(64, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    rm, rv = torch.zeros(4), torch.ones(4)

    def f(x: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rm, rv = rm.clone(), rv.clone()
        return F.batch_norm(x, rm, rv, training=True, momentum=1.0), rm, rv

    step = sharded(f, mesh=MESHES["dp"], in_specs=(P("dp"), P(), P()), out_specs=(P("dp"), P(), P()))
    _, got_rm, got_rv = step(x, rm, rv)
    _, want_rm, want_rv = f(x, rm, rv)
    torch.testing.assert_close(got_rv, want_rv)  # fp32 tolerance: not rounded through bf16
    torch.testing.assert_close(got_rm, want_rm)


def test_one_statistic_without_the_other_raises_as_eager_does() -> None:
    def f(x: torch.Tensor, rm: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rm = rm.clone()
        return F.batch_norm(x, rm, None, training=True), rm

    x, rm = torch.randn(8, 4), torch.zeros(4)
    with pytest.raises(ValueError, match="both be None or neither"):
        f(x, rm)
    with pytest.raises(ValueError, match="both be None or neither"):
        sharded(f, mesh=MESHES["dp"], in_specs=(P("dp"), P()), out_specs=(P("dp"), P()))(x, rm)


W = torch.zeros(4, 2)


@pytest.mark.parametrize(
    "write",
    [
        lambda x: W.__setitem__(0, x[0]),
        lambda x: W.view(-1).add_(1),
        lambda x: W.detach().add_(1),
        lambda x: W.t().mul_(2),
        lambda x: F.batch_norm(x, W[0], W[1], training=True),
    ],
    ids=["setitem", "view", "detach", "t", "bn_stats_view"],
)
def test_a_write_through_a_view_of_a_closed_over_tensor_is_refused(write: Any) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        write(x)
        return x + 1

    step = sharded(f, mesh=MESHES["dp"], in_specs=(P(None, None),), out_specs=P())
    with pytest.raises(ShardingError, match=r"closes over \(W, shape \(4, 2\)\)"):
        step(torch.ones(2, 2))
    assert torch.equal(W, torch.zeros(4, 2))


def test_writes_into_copies_of_closed_over_tensors_run_as_eager() -> None:
    """Ops on constants alone run on plain tensors when the step is functionalized: a write into
    their result (``b = W.clone(); b[2:4] = 0``, ``out=b``) was a PyTorch internal assert."""
    base = torch.randn(8, 4)

    def setitem(x: torch.Tensor) -> torch.Tensor:
        b = base.clone()
        b[2:4] = 0.0
        return b + x

    def out(x: torch.Tensor) -> torch.Tensor:
        b = base.clone()
        torch.mul(x, 2, out=b)
        return b + base

    x = torch.randn(8, 4)
    for fn in (setitem, out):
        for spec in (P("dp"), P(None, "dp")):
            got = sharded(fn, mesh=MESHES["dp"], in_specs=(spec,), out_specs=spec)(x)
            torch.testing.assert_close(got, fn(x))


def test_the_argument_error_names_the_line_writing_that_argument() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        b.requires_grad_(False)  # a flag, not a write
        a.mul_(2)
        return a + b

    step = sharded(f, mesh=MESHES["dp"], in_specs=(P(), P()), out_specs=P())
    with pytest.raises(ShardingError, match=r"a is modified in place at .*: a\.mul_\(2\)"):
        step(torch.ones(4), torch.ones(4))

    def g(x: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor) -> torch.Tensor:
        return torch.batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5, False)

    step = sharded(g, mesh=MESHES["dp"], in_specs=(P("dp"), P(), P()), out_specs=P("dp"))
    with pytest.raises(ShardingError, match=r"(?s)rm is modified in place at .*torch\.batch_norm.*clone"):
        step(torch.randn(8, 4), torch.zeros(4), torch.ones(4))
