"""Real torch.distributed (gloo) runs: the mesh's groups, initialization, and the test helper itself."""

import time

import pytest

from shardspec.testing import DistributedTestError, run_distributed
from tests import _dist_fns as fns

pytestmark = pytest.mark.multiprocess


def test_real_mesh_forms_rank_groups_per_axis():
    results = run_distributed(fns.mesh_groups, 4, timeout=60)
    expected_tp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    expected_dp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, out in enumerate(results):
        assert out["rank"] == rank
        assert out["coords"] == {"dp": rank // 2, "tp": rank % 2}
        assert out["tp"] == expected_tp[rank] and out["dp"] == expected_dp[rank]
        assert out["tp_sum"] == sum(expected_tp[rank])
        assert out["dp_sum"] == sum(expected_dp[rank])


def test_mesh_initializes_from_torchrun_environment():
    results = run_distributed(fns.mesh_from_torchrun_env, 2, backend=None, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["backend"] == "gloo" and r["names"] == ("dp",) for r in results)


def test_dtensor_places_blocks_where_our_layout_says():
    results = run_distributed(fns.dtensor_layout_matches, 4, timeout=60)
    assert all(len(r) == 6 for r in results)


def test_results_come_back_in_rank_order():
    assert [r["sum"] for r in run_distributed(fns.rank_sum, 3, timeout=30)] == [3.0] * 3


def test_a_raising_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 1 raised") as info:
        run_distributed(fns.raise_on_rank_1, 4, timeout=60)
    assert "deliberate failure on rank 1" in str(info.value)
    assert time.monotonic() - start < 30  # the others, blocked in all_reduce, were killed


def test_a_hung_rank_fails_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] still running"):
        run_distributed(fns.hang_on_rank_0, 2, timeout=3)
    assert time.monotonic() - start < 20
