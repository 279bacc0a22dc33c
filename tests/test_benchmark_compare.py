"""benchmarks.compare in a bounded form: a tiny GPT, world 2, one round of one step, every strategy.

Checks that the comparison is well formed (ratios computed and finite, launches and bytes counted,
the shardspec counts seen at run time equal the plan, both sides' first losses agree), never how
fast either side is.
"""

import math

import pytest

from benchmarks import compare
from benchmarks._compare_measure import ring_bytes
from examples.models import gpt

pytestmark = pytest.mark.multiprocess


def test_ring_byte_formulas():
    assert ring_bytes("all_reduce", 400, 4) == 600  # 2 (n-1)/n S
    assert ring_bytes("all_gather", 400, 4) == 300  # (n-1)/n S
    assert ring_bytes("reduce_scatter", 400, 2) == 200
    assert ring_bytes("all_reduce", 400, 1) == 0


def test_smoke_world_2_every_strategy():
    cfg = gpt.Config(vocab=16, seq=8, d=16, heads=2, layers=1)
    rows = compare.run(cfg, [2], ["dp", "zero3", "tp"], batch=2, rounds=1, steps=1, warmup=0, timeout=120)
    assert [r["strategy"] for r in rows] == ["dp", "zero3", "tp"]
    for r in rows:
        assert math.isfinite(r["ratio_median"]) and r["ratio_median"] > 0
        assert math.isfinite(r["ratio_min"]) and r["ratio_min"] > 0
        ss, tt = r["comm"]["shardspec"], r["comm"]["torch"]
        assert ss["launches"] > 0 and tt["launches"] > 0
        assert ss["bytes"] > 0 and tt["bytes"] > 0
        assert ss["observed_launches"] == ss["launches"]  # the plan is what ran
        assert ss["observed_bytes"] == ss["bytes"]
        first = r["loss"]
        assert math.isclose(first["shardspec"][0], first["torch"][0], rel_tol=1e-4)
    kinds = {r["strategy"]: set(r["comm"]["torch"]["launches_by_kind"]) for r in rows}
    assert kinds["dp"] == {"all_reduce"}  # DDP's bucketed gradient all-reduce
    assert kinds["zero3"] == {"all_gather", "reduce_scatter"}  # FSDP2
    assert "\n| 2 | tp |" in compare.table(rows)
