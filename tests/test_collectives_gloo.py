"""The collectives over real gloo process groups (2 and 4 processes) against the same references
and, exactly, against the simulated backend on identical inputs."""

import pytest
import torch

import collectives as C
from shardspec import Mesh
from shardspec.testing import run_distributed
from tests import _dist_fns as fns
from tests.collective_cases import call, cases, expected, inputs

pytestmark = pytest.mark.multiprocess
GLOO = {"SHARDSPEC_SAME_HOST": "0"}  # gloo's own collectives (and the two-rank exchanges)


def _simulated_bytes(mesh, case) -> float:
    with C.count_bytes() as counter:
        call(case, mesh, inputs(case, mesh))
    return counter.total_bytes_per_rank


@pytest.mark.parametrize("env", [{}, GLOO], ids=["same-host", "gloo"])
@pytest.mark.parametrize("axes", [{"x": 2}, {"dp": 2, "tp": 2}], ids=["2 procs", "4 procs dp x tp"])
def test_gloo_matches_reference_and_simulated(axes, env):
    """Bit-exact against the simulated backend through either transport (the same-host one
    combines in group position order, as the simulated mesh does)."""
    sim = Mesh(axes, simulate=True)
    batch = cases(sim)
    results = run_distributed(fns.run_collective_cases, sim.size, args=(axes,), timeout=240, env=env)
    failures = []
    for i, case in enumerate(batch):
        want = expected(case, sim)
        sim_out = call(case, sim, inputs(case, sim))
        for rank in range(sim.size):
            got = results[rank]["outs"][i]
            ok = (
                got.dtype == want[rank].dtype
                and got.shape == want[rank].shape
                and torch.equal(got, want[rank])
                and torch.equal(got, sim_out[rank])
            )
            if not ok:
                failures.append(f"{case.name} rank {rank}: got {got} want {want[rank]}")
        # each process counts only itself; the busiest rank equals the simulated figure
        assert max(results[r]["bytes"][i] for r in range(sim.size)) == _simulated_bytes(sim, case), case.name
    assert not failures, "\n".join(failures[:5]) + f"\n({len(failures)} failures)"
    assert len(batch) >= 70


@pytest.mark.parametrize("same_host", ["1", "0"], ids=["same-host", "gloo"])
def test_async_wait_and_send_recv_on_gloo(same_host):
    """Two in-place all-reduces of one buffer's parts are each pending on their own until their
    waits, through gloo and through the same-host transport (which runs them at the waits)."""
    env = {"SHARDSPEC_SAME_HOST": same_host}
    r0, r1 = run_distributed(fns.async_and_p2p, 2, timeout=60, env=env)
    want = torch.cat([torch.zeros(4, 2), torch.ones(4, 2)])
    for r in (r0, r1):
        assert torch.equal(r["gathered"], want)
        assert torch.equal(r["reduced"], torch.ones(4, 2))
        assert r["pending"] == 2
        assert torch.equal(r["buf"], torch.arange(8.0) * 3)
    assert torch.equal(r1["got"], torch.full((4, 2), 10.0))


def test_review_regressions_on_gloo():
    results = run_distributed(fns.review_regressions, 4, timeout=60)
    assert torch.equal(results[3]["recv"], torch.full((2,), 7.0))
    for rank, r in enumerate(results):
        assert torch.equal(r["grad_rs"], torch.full((2,), 4.0))
        assert r["empty"].shape == (0, 3)
        partner = rank ^ 1  # the other member of this rank's 'b' group
        a, b = sorted((rank, partner))
        want_sum = torch.arange(6.0).reshape(2, 3) * 2 + a + b
        assert torch.equal(r["all_reduce"], want_sum)
        assert torch.equal(r["broadcast"], torch.arange(6.0).reshape(2, 3) + b)
        assert torch.equal(r["ppermute"], torch.arange(6.0).reshape(2, 3) + partner)
        assert "holds 2 along dim 0" in r["size_error"]


def test_two_rank_gloo_groups_exchange_point_to_point():
    """Two-rank gloo groups run all-gather and reduce-scatter as one tagged send/receive pair
    (faster than gloo's collectives; see collectives/pairwise.py), with other point-to-point
    traffic on the same group posted while they are in flight; four-rank groups keep c10d's. (On
    one host the same-host transport comes first: it is turned off here.)"""
    r = run_distributed(fns.pairwise_exchanges, 2, timeout=60, env=GLOO)
    x = [torch.arange(6.0).reshape(3, 2) + 10 * rank for rank in range(2)]
    for rank in range(2):
        assert torch.equal(r[rank]["gathered"], torch.cat(x, 1))
        assert torch.equal(r[rank]["scattered"], (x[0] + x[1]).t()[rank : rank + 1])
        assert torch.equal(r[rank]["shifted"], torch.full((5,), float(1 - rank)))
        assert r[rank]["posted"] == 2
    r = run_distributed(fns.pairwise_exchanges, 4, timeout=60, env=GLOO)
    for rank in range(4):  # dp groups {0, 2} {1, 3}; tp groups {0, 1} {2, 3}
        dp_peers = [rank % 2, rank % 2 + 2]
        assert torch.equal(r[rank]["dp"], torch.cat([torch.full((4, 2), float(p)) for p in dp_peers]))
        tp_max = float(rank // 2 * 2 + 1)
        assert torch.equal(r[rank]["tp"], torch.full((2, 2), tp_max))
        assert torch.equal(r[rank]["both"], torch.cat([torch.full((4, 2), float(p)) for p in (0, 1, 2, 3)]))
        assert r[rank]["posted"] == 2 and r[rank]["four_rank_posted"] == 0


def test_two_rank_exchanges_at_their_edges():
    r = run_distributed(fns.pairwise_edges, 2, timeout=60, env=GLOO)
    total = 2 * torch.arange(8.0) + 100
    for rank in range(2):
        assert torch.equal(r[rank]["written_after_issue"], total[4 * rank : 4 * rank + 4])
        assert r[rank]["empty"] == ((4, 0), (2, 0))
        gathered, scattered = r[rank]["grad_inputs"]
        assert torch.equal(gathered, torch.ones(8)) and torch.equal(scattered, torch.full((2,), 2.0))
        assert torch.equal(r[rank]["after_step"], torch.tensor([0.0, 1.0]))
        gathered, scattered = r[rank]["dim1"]
        want = torch.cat([torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(2, 3) + 10], 1)
        assert torch.equal(gathered, want) and gathered.is_contiguous()
        assert torch.equal(scattered, torch.full((2, 2), 2.0)) and scattered.is_contiguous()
    assert r[0]["dim1_issue_s"] < 0.5  # rank 1 came a second late: issuing did not wait for it
    # max in position order, as the simulated mesh combines: torch.maximum(-0.0, 0.0) is -0.0
    zeros = [torch.tensor([-0.0, 0.0, 0.0, -0.0]), torch.tensor([0.0, -0.0, -0.0, 0.0])]
    want = torch.maximum(zeros[0], zeros[1])
    got = torch.cat([r[0]["max_zeros"], r[1]["max_zeros"]])
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_fused_attention_after_last_dim_gathers_on_gloo():
    """A real gather along a dim other than 0 returns dense memory, as the compiled program (and the
    fake and simulated collectives) expect: fused attention read strided rows as dense (garbage)."""
    for errors in run_distributed(fns.attention_after_last_dim_gathers, 2, timeout=120):
        assert max(errors) < 1e-6, errors
