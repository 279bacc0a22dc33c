"""Pipeline schedules as properties over p, m, v: each checked list runs every action once in
dependency order without deadlock; planned bubbles follow the formulas; in-flight bounds hold."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.pipeline.check import Op, check, check_schedule, peak_in_flight, simulate, transfers, with_p2p
from compiler.pipeline.schedules import Action, one_f_one_b, schedule
from compiler.pipeline.stages import linear_partition
from shardspec.errors import ShardingError

ps = st.integers(1, 6)
ms = st.integers(1, 12)


def _order_ok(lists):
    for acts in lists:
        where = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a.kind == "B":
                assert where[Action("F", a.stage, a.mb)] < where[a]
            if a.kind == "W":
                assert where[Action("B", a.stage, a.mb)] < where[a]


@settings(max_examples=60, deadline=None)
@given(p=ps, m=ms, name=st.sampled_from(["gpipe", "1f1b", "zb-h1"]))
def test_schedules_check_and_order(p, m, name):
    lists = schedule(name, p, m)
    check_schedule(lists, p, m)
    _order_ok(lists)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 4), k=st.integers(1, 3), v=st.integers(2, 3))
def test_interleaved_checks_and_bubble_is_divided_by_v(p, k, v):
    m = k * p
    lists = schedule("interleaved", p, m, v)
    check_schedule(lists, p, m)
    _order_ok(lists)
    # idle time per rank is (p - 1) chunk-steps of a stage that is 1/v of a rank's model
    assert simulate(lists).bubble == pytest.approx((p - 1) / (v * m + p - 1))


@settings(max_examples=60, deadline=None)
@given(p=ps, m=ms, name=st.sampled_from(["gpipe", "1f1b"]))
def test_gpipe_and_1f1b_bubble_formula(p, m, name):
    assert simulate(schedule(name, p, m)).bubble == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 6), extra=st.integers(0, 8))
def test_zb_h1_idle_time_at_most_04_of_1f1b(p, extra):
    """With T_F = T_B = T_W and at least p microbatches (the steady state ZB-H1 is built for)."""
    m = p + extra
    zb, base = simulate(schedule("zb-h1", p, m)), simulate(schedule("1f1b", p, m))
    idle = zb.bubble * zb.makespan
    assert idle <= 0.4 * base.bubble * base.makespan + 1e-9
    assert max(peak_in_flight(schedule("zb-h1", p, m))) <= p


@settings(max_examples=60, deadline=None)
@given(p=ps, m=ms)
def test_1f1b_holds_at_most_p_microbatches(p, m):
    assert max(peak_in_flight(schedule("1f1b", p, m))) <= min(p, m)
    assert max(peak_in_flight(schedule("gpipe", p, m))) == m


def test_checker_finds_a_deadlock():
    """Rank 0 waits for gradients before sending the activations they need."""
    lists = ((Action("B", 0, 0), Action("F", 0, 0)), (Action("F", 1, 0), Action("B", 1, 0)))
    with pytest.raises(ShardingError, match=r"before its input|deadlocks"):
        check_schedule(lists, 2, 1)


def test_checker_finds_a_wrong_message():
    """Rank 1 receives b first, but rank 0 sent a first: a FIFO would hand it the wrong tensor."""
    ops = ((Op("compute", "x"), Op("send", "a", 1), Op("send", "b", 1)), (Op("recv", "b", 0),))
    with pytest.raises(ShardingError, match="expects b"):
        check(ops, lambda a: [], {"a": "x", "b": "x"})


def test_receives_follow_the_senders_order():
    """Interleaved: two streams between the same ranks arrive in the sender's order."""
    lists = schedule("interleaved", 2, 4, 2)
    ops = with_p2p(lists, transfers(lists, 2))
    sent = [op.what for op in ops[0] if op.kind == "send"]
    got = [op.what for op in ops[1] if op.kind == "recv"]
    assert got == sent


def test_one_f_one_b_lists_alternate():
    lists = one_f_one_b(4, 8)
    assert [str(a) for a in lists[3][:4]] == ["F3.0", "B3.0", "F3.1", "B3.1"]


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(1, 50), min_size=1, max_size=8), data=st.data())
def test_linear_partition_minimizes_the_largest_stage(costs, data):
    """The chosen cuts give the smallest largest-stage cost of all ways to cut into k stages."""
    k = data.draw(st.integers(1, len(costs)))
    starts = linear_partition(costs, k)
    bounds = [0, *starts, len(costs)]
    assert len(starts) == k - 1 and all(a < b for a, b in itertools.pairwise(bounds))
    got = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, len(costs))))
        for cut in itertools.combinations(range(1, len(costs)), k - 1)
    )
    assert got == best
