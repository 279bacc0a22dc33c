"""The same-host transport (collectives/same_host.py): processes of one host read each other's buffers.

Its results must equal the simulated mesh's bit for bit (it combines in group position order), also
when a block spans many read pieces, for three members (uneven blocks) and for a group whose c10d
order is not its position order; the probe must agree on every member, leave no file behind, and
fall back to gloo everywhere when one member has it off; a peer that never arrives is the step's
timeout error, not a hang."""

import os

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives import kernels
from shardspec import Mesh
from shardspec.testing import run_distributed

pytestmark = pytest.mark.multiprocess
OPS = ("sum", "avg", "max", "min")


def _values(world: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input (the same on every rank), with signed zeros where max and min see them."""
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
    for r, x in enumerate(xs):
        x[:8] = torch.tensor([0.0, -0.0] * 4) * (1 if r % 2 else -1)
    return xs


def exact(rank: int, world: int) -> dict[str, bool]:
    from collectives import same_host

    same_host.PIECE_BYTES = 64  # a block spans many pieces
    mesh = Mesh({"x": world})
    out: dict[str, bool] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        xs = _values(world, 1001, dtype)  # 1001 = uneven blocks over 2 and 3 members
        for op in OPS if dtype.is_floating_point else ("sum", "max"):
            got = C.all_reduce(xs[rank], axis="x", mesh=mesh, op=op)
            want = kernels.reduce(xs, op)
            out[f"all_reduce {op} {dtype}"] = torch.equal(got, want) and bool(
                torch.equal(torch.signbit(got.float()), torch.signbit(want.float()))
            )
        rows = [x[: 990 // world * world].reshape(-1, 3) for x in xs]
        got = C.reduce_scatter(rows[rank], dim=0, axis="x", mesh=mesh, op="sum")
        out[f"reduce_scatter {dtype}"] = torch.equal(got, kernels.reduce(rows, "sum").chunk(world)[rank])
        cols = [r.t().contiguous() for r in rows]
        got = C.reduce_scatter(cols[rank], dim=1, axis="x", mesh=mesh, op="max")
        want = kernels.reduce(cols, "max").chunk(world, 1)[rank]
        out[f"reduce_scatter dim 1 {dtype}"] = torch.equal(got, want)
        got = C.all_gather(rows[rank], dim=1, axis="x", mesh=mesh)
        out[f"all_gather dim 1 {dtype}"] = torch.equal(got, torch.cat(rows, 1)) and got.is_contiguous()
    out["probed"] = any(h is not None for _, h in same_host._hosts.values())
    out["no file"] = not any(p.name.startswith(f"shardspec-{os.getppid()}") for p in same_host._SHM.iterdir())
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_same_host_collectives_equal_the_simulated_mesh_bit_for_bit(world):
    for r in run_distributed(exact, world, timeout=120):
        assert r.pop("probed") and r.pop("no file")
        assert all(r.values()), [k for k, ok in r.items() if not ok]


def permuted(rank: int, world: int) -> dict[str, object]:
    """A tuple of axes listed minor-first: position order (a, then b) differs from c10d's."""
    from collectives import same_host

    mesh = Mesh({"a": 2, "b": 2})
    xs = _values(4, 64, torch.float32)
    group = mesh.group_of(rank, ("b", "a"))
    mine = xs[rank]
    got = C.all_reduce(mine, axis=("b", "a"), mesh=mesh, op="max")
    want = kernels.reduce([xs[g] for g in group], "max")
    return {
        "equal": torch.equal(got, want) and bool(torch.equal(torch.signbit(got), torch.signbit(want))),
        "group": group,
        "probed": any(h is not None for _, h in same_host._hosts.values()),
    }


def test_a_group_in_other_than_c10d_order_combines_in_position_order():
    results = run_distributed(permuted, 4, timeout=120)
    assert results[0]["group"] != sorted(results[0]["group"])  # the case this test is about
    for r in results:
        assert r["equal"] and r["probed"]


def one_member_off(rank: int, world: int) -> dict[str, object]:
    from collectives import same_host

    if rank == 1:
        os.environ[same_host.ENV] = "0"
    mesh = Mesh({"x": world})
    got = C.all_reduce(torch.full((3,), float(rank)), axis="x", mesh=mesh)
    return {"sum": got, "hosts": [h for _, h in same_host._hosts.values()]}


def test_one_member_with_it_off_turns_it_off_for_the_group():
    for r in run_distributed(one_member_off, 2, timeout=60):
        assert torch.equal(r["sum"], torch.ones(3))
        assert r["hosts"] == [None]


def absent_peer(rank: int, world: int) -> str:
    from collectives import distributed

    mesh = Mesh({"x": world})
    C.all_reduce(torch.ones(2), axis="x", mesh=mesh)  # the probe, on both
    if rank == 1:
        return "stayed away"
    distributed.set_wait_timeout(1.0)
    try:
        C.all_reduce(torch.ones(2), axis="x", mesh=mesh)
    except Exception as exc:  # the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def test_a_peer_that_never_arrives_is_the_timeout_error():
    waited, _ = run_distributed(absent_peer, 2, timeout=60)
    assert waited.startswith("ShardingError") and "did not complete within 1 s" in waited, waited
    assert "never reached a same-host collective" in waited


def exiting_peer(rank: int, world: int, path: str) -> None:
    """Rank 1 exits after the probe; rank 0, outside any step (no step timeout), must notice."""
    import time
    from pathlib import Path

    mesh = Mesh({"x": world})
    C.all_reduce(torch.ones(2), axis="x", mesh=mesh)
    if rank == 1:
        os._exit(0)
    started = time.monotonic()
    try:
        C.all_reduce(torch.ones(2), axis="x", mesh=mesh)
        message = "returned"
    except Exception as exc:  # the message is the result
        message = f"{type(exc).__name__}: {exc}"
    Path(path).write_text(f"{time.monotonic() - started:.1f} {message}")
    os._exit(0)  # its peer is gone: no barrier to end on


def test_a_peer_that_exited_is_an_error_at_once_not_a_wait(tmp_path):
    from shardspec.testing import DistributedTestError

    out = tmp_path / "rank0.txt"
    with pytest.raises(DistributedTestError):
        run_distributed(exiting_peer, 2, args=(str(out),), timeout=15)
    waited, message = out.read_text().split(" ", 1)
    assert float(waited) < 5, message  # the group's timeout is 15 s
    assert message.startswith("ShardingError") and "exited" in message, message


def reinitialized(rank: int, world: int, off: str, folder: str) -> list[float]:
    """Groups destroyed and made again in the same processes: each new group is probed anew (an
    entry keyed by a recycled address made one rank skip the probe its peer ran: a hang)."""
    import datetime

    from collectives import same_host

    os.environ[same_host.ENV] = off
    got = []
    for i in range(8):
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{folder}/group-{i}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=20),
        )
        junk = [object() for _ in range(rank * 3)]  # the allocators differ between the ranks
        got.append(float(C.all_reduce(torch.full((2,), rank + 1.0), axis="x", mesh=Mesh({"x": world}))[0]))
        del junk
    return got


@pytest.mark.parametrize("off", ["0", "1"], ids=["declined", "taken"])
def test_groups_made_again_in_the_same_processes_are_probed_again(off, tmp_path):
    for got in run_distributed(reinitialized, 2, args=(off, str(tmp_path)), timeout=120):
        assert got == [3.0] * 8


def test_the_transport_benchmark_runs_and_prints_both_ways(capsys):
    from benchmarks import transport

    transport.main(["--world", "2", "--sizes", "4096", "--rounds", "1"])
    out = capsys.readouterr().out
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        assert f"| {kind} | 4096 |" in out


def waits_in_any_order(rank: int, world: int) -> dict[str, list[float]]:
    """Async collectives pair by issue order, as c10d's do, whatever order each rank waits in; a
    rank that never waits for one does not hold its peers up."""
    mesh = Mesh({"x": world})
    a = C.all_reduce(torch.full((4,), rank + 1.0), axis="x", mesh=mesh, async_op=True)
    b = C.all_reduce(torch.full((1 << 16,), 100.0 + rank), axis="x", mesh=mesh, async_op=True)
    first, second = (a, b) if rank == 0 else (b, a)
    C.wait(first)
    C.wait(second)
    metric = C.all_reduce(torch.full((2,), float(rank)), axis="x", mesh=mesh, async_op=True)
    grads = C.all_reduce(torch.full((3,), 10.0), axis="x", mesh=mesh)
    if rank == 0:
        C.wait(metric)  # only rank 0 waits for the metric
    return {"a": a.tolist(), "b": b[:2].tolist(), "grads": grads.tolist(), "metric": metric.tolist()}


def test_async_collectives_pair_by_issue_order_whatever_the_wait_order():
    for rank, r in enumerate(run_distributed(waits_in_any_order, 2, timeout=60)):
        assert r["a"] == [3.0] * 4 and r["b"] == [201.0] * 2 and r["grads"] == [20.0] * 3, r
        if rank == 0:
            assert r["metric"] == [1.0, 1.0]
