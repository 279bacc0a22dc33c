"""The global planner (``sharded(cost_model=...)``): the cost model's formulas, the textbook plans it
picks where greedy propagation does not, and that it never models a step slower than greedy's.

N = 4 data-parallel devices, phi = (N - 1) / N, Psi = parameter count, fp32 (4 bytes).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import collectives
from compiler.plan import CostModel, modeled_time
from compiler.plan.costmodel import op_flops
from compiler.rules.notation import parse
from examples.models import mlp
from shardspec import Mesh, P, optim, sharded

N = 4
PHI = (N - 1) / N
OPT = optim.adamw(lr=1e-2, weight_decay=0.0)
STEP = mlp.make_step(OPT)
BANDWIDTH_ONLY = CostModel(latency_s=0.0)  # seconds proportional to bytes (compute ~free)


def _lower(sizes, batch, pspec, bspec, cost_model, mesh=None):
    d_in, d_hidden, d_out = sizes
    mesh = mesh or Mesh({"dp": N}, simulate=True)
    torch.manual_seed(0)
    params = mlp.init(d_in, d_hidden, d_out)
    x, y = torch.randn(batch, d_in), torch.randint(0, d_out, (batch,))
    args = (params, OPT.init(params), x, y)
    f = sharded(
        STEP,
        mesh=mesh,
        in_specs=(pspec, OPT.state_specs(pspec), bspec, bspec),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
        cost_model=cost_model,
    )
    low = f.lower(*args)
    with collectives.count_bytes() as counter:
        out = f(*args)
    want = STEP(*args)
    for a, b in zip(out[0].values(), want[0].values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counter.total_bytes_per_rank == low.cost().comm_bytes_per_rank  # planned == sent
    return low


def _modeled(low, model):
    p = low.program
    return modeled_time(p.traced.module.graph, p.prop, p.mesh, model).total_s


def _tensors(low):
    return [r for r in low.collectives() if r.shape != ()]


# ---- the cost model ---------------------------------------------------------------------------


def test_collective_seconds_follow_the_ring_formulas():
    mesh = Mesh({"dp": 4, "tp": 2}, simulate=True)
    m = CostModel(bandwidth_bytes_per_s=1e9, latency_s=1e-6, bandwidth={"tp": 4e9}, latency={"tp": 2e-6})
    sent = 3e6  # ring bytes per rank, as reshard.py counts them
    assert m.collective_s("all_reduce", ("dp",), sent, mesh) == pytest.approx(2 * 3 * 1e-6 + sent / 1e9)
    assert m.collective_s("all_gather", ("tp",), sent, mesh) == pytest.approx(1 * 2e-6 + sent / 4e9)
    # a tuple of axes: one ring over 8 devices at the slowest member's link
    assert m.collective_s("reduce_scatter", ("dp", "tp"), sent, mesh) == pytest.approx(7 * 2e-6 + sent / 1e9)
    assert m.collective_s("slice", ("dp",), sent, mesh) == 0.0


def test_flops_count_matmuls_exactly_and_split_factors_divide_them():
    mm = parse("i k, k j -> i j", "one")
    sizes = {"i": 8, "k": 16, "j": 32}
    assert op_flops(mm, sizes, {}, view=False) == 2 * 8 * 16 * 32
    assert op_flops(mm, sizes, {"i": 4}, view=False) == 2 * 2 * 16 * 32
    add = parse("a b, a b -> a b", "all")
    assert op_flops(add, {"a": 8, "b": 4}, {"a": 2}, view=False) == 4 * 4


def test_cost_reports_modeled_time_with_its_parts():
    low = _lower((8, 16, 4), 16, {"w1": P(), "b1": P(), "w2": P()}, P("dp"), None)
    c = low.cost()
    assert c.modeled_comm_s > 0 and c.modeled_compute_s > 0
    assert c.modeled_time_s == pytest.approx(c.modeled_comm_s + c.modeled_compute_s)


# ---- textbook plans ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [32, 64])
def test_zero3_mlp_gathers_parameters_and_reduce_scatters_gradients(batch):
    """Where gathering the batch would send at least the parameters' bytes, ZeRO-3 stays ZeRO-3."""
    sizes = (8, 16, 4)
    psi = 8 * 16 + 16 + 16 * 4
    assert batch * sizes[0] >= psi
    pspec = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
    low = _lower(sizes, batch, pspec, P("dp"), BANDWIDTH_ONLY)
    tensors = _tensors(low)
    gathers = [r for r in tensors if r.kind == "all_gather"]
    scatters = [r for r in tensors if r.kind == "reduce_scatter"]
    assert len(gathers) + len(scatters) == len(tensors)  # no all-to-all, no activation gathers
    assert sum(r.bytes_per_rank for r in gathers) == PHI * (psi + 16 * 4) * 4  # w2 again for backward
    assert sum(r.bytes_per_rank for r in scatters) == PHI * psi * 4


@settings(max_examples=6, deadline=None)
@given(
    sizes=st.sampled_from([(8, 16, 4), (16, 32, 8), (4, 32, 4), (32, 16, 8), (16, 16, 16)]),
    extra=st.integers(0, 12),
    planner=st.booleans(),
)
def test_zero3_mlp_stays_zero3_at_every_batch_where_moving_activations_costs_more(sizes, extra, planner):
    """Greedy propagation and the planner alike: from the first batch (a multiple of N) whose input
    holds at least Psi elements (gathering it sends at least the parameters' bytes; the tie
    included), ZeRO-3 compiles to parameter gathers and gradient reduce-scatters, never tensor
    parallelism over dp."""
    d_in, d_hidden, d_out = sizes
    psi = d_in * d_hidden + d_hidden + d_hidden * d_out
    batch = -(-psi // d_in // N) * N + N * extra  # at least psi / d_in, a multiple of N
    assert batch * d_in >= psi
    pspec = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
    low = _lower(sizes, batch, pspec, P("dp"), BANDWIDTH_ONLY if planner else None)
    tensors = _tensors(low)
    gathers = [r for r in tensors if r.kind == "all_gather"]
    scatters = [r for r in tensors if r.kind == "reduce_scatter"]
    assert len(gathers) + len(scatters) == len(tensors)
    assert sum(r.bytes_per_rank for r in gathers) == PHI * (psi + d_hidden * d_out) * 4
    assert sum(r.bytes_per_rank for r in scatters) == PHI * psi * 4


@pytest.mark.parametrize("sizes,batch", [((32, 64, 8), 16), ((16, 32, 4), 16), ((8, 64, 4), 32)])
def test_zero3_at_small_batch_the_planner_sends_fewer_bytes_than_greedy(sizes, batch):
    """Small batches: moving activations is cheaper than the parameters; greedy keeps ZeRO-3's
    gathers, the planner finds the plan that sends fewer bytes (and results stay equal)."""
    pspec = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
    greedy = _lower(sizes, batch, pspec, P("dp"), None)
    planned = _lower(sizes, batch, pspec, P("dp"), BANDWIDTH_ONLY)
    assert planned.cost().comm_bytes_per_rank < greedy.cost().comm_bytes_per_rank
    assert _modeled(planned, BANDWIDTH_ONLY) < _modeled(greedy, BANDWIDTH_ONLY)


FAST_NETWORK = CostModel(bandwidth_bytes_per_s=1e12, latency_s=1e-7, flops_per_s=1e9)
SLOW_NETWORK = CostModel(bandwidth_bytes_per_s=1e8, latency_s=1e-4, flops_per_s=1e15)


def test_dp_at_batch_8_all_reduces_gradients_on_a_fast_network():
    rep = {"w1": P(), "b1": P(), "w2": P()}
    low = _lower((16, 32, 8), 8, rep, P("dp"), FAST_NETWORK)
    psi = 16 * 32 + 32 + 32 * 8
    reduces = [r for r in _tensors(low) if r.kind == "all_reduce"]
    assert sum(r.bytes_per_rank for r in reduces) == 2 * PHI * psi * 4  # every gradient, once
    # the batch stays split: no rank recomputes the full-batch products
    graph, prop = low.program.traced.module.graph, low.program.prop
    full = _lower((16, 32, 8), 8, rep, P(), None).program
    split = modeled_time(graph, prop, low.program.mesh, FAST_NETWORK).compute_s
    assert split < modeled_time(full.traced.module.graph, full.prop, full.mesh, FAST_NETWORK).compute_s / 2


def test_dp_at_batch_8_on_a_slow_network_follows_the_modeled_time():
    """Slow links, fast compute: gathering the small batch and recomputing beats all-reducing Psi."""
    rep = {"w1": P(), "b1": P(), "w2": P()}
    greedy = _lower((16, 32, 8), 8, rep, P("dp"), None)
    planned = _lower((16, 32, 8), 8, rep, P("dp"), SLOW_NETWORK)
    assert not [r for r in _tensors(planned) if r.kind == "all_reduce"]
    assert _modeled(planned, SLOW_NETWORK) < _modeled(greedy, SLOW_NETWORK)
    assert planned.cost().comm_bytes_per_rank < greedy.cost().comm_bytes_per_rank


def test_a_one_device_mesh_keeps_the_greedy_plan():
    mesh = Mesh({"dp": 1}, simulate=True)
    low = _lower((8, 16, 4), 8, {"w1": P(), "b1": P(), "w2": P()}, P("dp"), BANDWIDTH_ONLY, mesh=mesh)
    assert low.cost().comm_bytes_per_rank == 0


def test_zero3_over_an_axis_tuple_reduce_scatters_gradients():
    """Parameters split over ("dp", "tp"), batch over dp: each gradient is pending over dp only; it is
    reduce-scattered over dp (the major blocks) and sliced over tp locally, never all-reduced."""
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    tup = {"w1": P(("dp", "tp")), "b1": P(("dp", "tp")), "w2": P(("dp", "tp"))}
    low = _lower((8, 16, 4), 16, tup, P("dp"), None, mesh=mesh)
    psi = 8 * 16 + 16 + 16 * 4
    scatters = [r for r in _tensors(low) if r.kind == "reduce_scatter"]
    assert not [r for r in _tensors(low) if r.kind == "all_reduce"]
    assert sum(r.bytes_per_rank for r in scatters) == (2 - 1) / 2 * psi * 4  # phi_dp * Psi * 4
