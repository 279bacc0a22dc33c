"""The rank-agreement check on one host (shardspec/agree.py through ``same_host.Host.exchange``):
after the first call's gloo check the group is probed and later checks exchange one digest in
shared memory, with no gloo collective; differing calls are still named, an absent rank is still
the timeout error, and a rank that calls a collective of its own where another calls the step
gets an error on both sides instead of a hang or garbage."""

import pytest
import torch
import torch.distributed as dist

import collectives as C
from shardspec import Mesh, P, sharded
from shardspec.testing import run_distributed

pytestmark = pytest.mark.multiprocess


def _step(mesh: Mesh, timeout: float = 60):
    return sharded(lambda x, lr: x * lr, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), timeout=timeout)


def _message(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as exc:  # the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def agreements(rank: int, world: int) -> dict[str, object]:
    from collectives import same_host

    mesh = Mesh({"x": world})
    f = _step(mesh)
    x, lr = torch.arange(4.0), torch.tensor(0.5)
    f(x, lr)  # the gloo check; every rank agreed, so the group is probed
    pg = dist.distributed_c10d._get_default_group()
    probed = same_host.probed(pg) is not None
    launched: list[str] = []
    gloo_all_reduce = dist.all_reduce

    def counting(*args, **kwargs):
        launched.append("all_reduce")
        return gloo_all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    try:
        second = f(x, lr).full_tensor()
        differs = _message(f, x, torch.tensor(0.25 if rank else 0.5))
        after = f(x, lr).full_tensor()  # a check that failed on every rank alike leaves the group usable
    finally:
        dist.all_reduce = gloo_all_reduce
    return {"probed": probed, "launched": launched, "second": second, "differs": differs, "after": after}


def test_later_checks_go_through_shared_memory_and_still_name_differences():
    for r in run_distributed(agreements, 2, timeout=120):
        assert r["probed"]
        assert r["launched"] == []  # no gloo all-reduce for the checks (the program has none)
        assert torch.equal(r["second"], torch.arange(4.0) * 0.5)
        assert torch.equal(r["after"], torch.arange(4.0) * 0.5)
        assert "with different arguments" in r["differs"] and "lr" in r["differs"], r["differs"]


def absent(rank: int, world: int) -> str:
    mesh = Mesh({"x": world})
    f = _step(mesh, timeout=1)
    f(torch.arange(4.0), torch.tensor(0.5))
    if rank == 1:
        return "stayed away"
    return _message(f, torch.arange(4.0), torch.tensor(0.5))


def test_an_absent_rank_is_the_check_timeout_error():
    waited, _ = run_distributed(absent, 2, timeout=60)
    assert waited.startswith("ShardingError"), waited
    assert "rank-agreement check at the start of" in waited and "within 1 s" in waited, waited


def late_first(rank: int, world: int) -> tuple[str, float]:
    import time

    f = _step(Mesh({"x": world}), timeout=1)
    if rank == 1:
        time.sleep(2)  # rank 0's first check has timed out, but stays posted
    start = time.monotonic()
    got = _message(f, torch.arange(4.0), torch.tensor(0.5))
    took = time.monotonic() - start
    if rank == 0:
        time.sleep(4)  # alive (it caught the error), in no collective
    return got, took


def test_a_rank_late_for_the_first_check_gets_the_timeout_error_not_a_hang():
    """Its check pairs with the timed-out one still posted and agrees; the group's probe that
    follows then waits for a peer that never joins: within the check's timeout, not gloo's."""
    for message, took in run_distributed(late_first, 2, timeout=60):
        assert message.startswith("ShardingError") and "within 1 s" in message, message
        assert took < 3, took


def checkpoint_against_step(rank: int, world: int, root: str, call: str) -> str:
    import shardspec.checkpoint as ck

    f = _step(Mesh({"x": world}), timeout=10)
    f(torch.arange(4.0), torch.tensor(0.5))
    if call == "load":
        ck.save(root, {"a": torch.ones(3)}, step=1, timeout=10)
    if rank == 0:
        return _message(f, torch.arange(4.0), torch.tensor(0.5))
    if call == "load":
        return _message(lambda: ck.load(root, like={"a": torch.ones(3)}, timeout=10))
    return _message(lambda: ck.save(root, {"a": torch.ones(3)}, step=1, timeout=10))


@pytest.mark.parametrize("call", ["save", "load"])
@pytest.mark.parametrize("same_host", ["1", "0"])
def test_a_checkpoint_call_against_a_step_is_named_on_both_ranks(tmp_path, same_host, call):
    env = {"SHARDSPEC_SAME_HOST": same_host}
    before = sorted(tmp_path.iterdir()) if call == "save" else None
    step, other = run_distributed(checkpoint_against_step, 2, args=(str(tmp_path), call), timeout=60, env=env)
    assert step.startswith("ShardingError") and f"rank 1: checkpoint.{call}" in step, step
    assert other.startswith("ShardingError") and "rank 0: a sharded step" in other, other
    if before is not None:
        assert sorted(tmp_path.iterdir()) == before  # nothing written


def crossed(rank: int, world: int) -> str:
    mesh = Mesh({"x": world})
    f = _step(mesh, timeout=3)
    f(torch.arange(4.0), torch.tensor(0.5))
    C.all_reduce(torch.ones(2), axis="x", mesh=mesh)  # the mesh's group probed too
    if rank == 1:
        from collectives import distributed

        distributed.set_wait_timeout(3.0)
        return _message(lambda: C.all_reduce(torch.ones(1000), axis="x", mesh=mesh))
    return _message(f, torch.arange(4.0), torch.tensor(0.5))


def test_a_collective_against_a_check_is_an_error_on_both_ranks():
    step, collective = run_distributed(crossed, 2, timeout=60)
    assert step.startswith("ShardingError") and "met another collective" in step, step
    assert collective.startswith("ShardingError") and "rank-agreement check instead" in collective
