"""Tracing, exact byte formulas, SPMD checks and error messages of the collectives."""

import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import collectives as C
from shardspec import Mesh, ShardingError

MESH = Mesh({"dp": 2, "tp": 4}, simulate=True)
X = torch.zeros(8, 12)


@pytest.mark.parametrize(
    "fn,text",
    [
        (
            lambda t: C.all_gather(t, dim=1, axis="tp", mesh=MESH, size=48),
            "all_gather.default(t_1, dim = 1, axis = 'tp', mesh = 'dp=2,tp=4;sim', size = 48)",
        ),
        (
            lambda t: C.reduce_scatter(t, dim=0, axis=("dp", "tp"), mesh=MESH, op="avg"),
            "reduce_scatter.default(t_1, dim = 0, axis = 'dp,tp', mesh = 'dp=2,tp=4;sim', op = 'avg')",
        ),
        (
            lambda t: C.all_reduce(t, axis="dp", mesh=MESH),
            "all_reduce.default(t_1, axis = 'dp', mesh = 'dp=2,tp=4;sim')",
        ),  # default op elided
        (
            lambda t: C.all_to_all(t, split_dim=0, concat_dim=1, axis="tp", mesh=MESH),
            "all_to_all.default(t_1, split_dim = 0, concat_dim = 1, axis = 'tp', mesh = 'dp=2,tp=4;sim')",
        ),
        (
            lambda t: C.ppermute(t, axis="tp", perm=[(0, 1), (1, 0)], mesh=MESH),
            "ppermute.default(t_1, axis = 'tp', perm = [0, 1, 1, 0], mesh = 'dp=2,tp=4;sim')",
        ),
        (
            lambda t: C.broadcast(t, axis="dp", src=1, mesh=MESH),
            "broadcast.default(t_1, axis = 'dp', src = 1, mesh = 'dp=2,tp=4;sim')",
        ),
    ],
    ids=["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "ppermute", "broadcast"],
)
def test_each_op_traces_as_one_readable_node(fn, text):
    gm = make_fx(fn, tracing_mode="fake")(X)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(calls) == 1 and calls[0].target.namespace == "shardspec"
    assert text in gm.code, gm.code


def test_traced_shapes():
    gm = make_fx(lambda t: C.all_gather(t, dim=1, axis="tp", mesh=MESH), tracing_mode="fake")(X)
    out = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert tuple(out.meta["val"].shape) == (8, 48)
    gm = make_fx(
        lambda t: C.all_to_all(t, split_dim=0, concat_dim=1, axis="tp", mesh=MESH), tracing_mode="fake"
    )(X)
    out = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert tuple(out.meta["val"].shape) == (2, 48)


def test_send_recv_wait_trace_and_send_survives_dead_code_elimination():
    def f(t):
        C.send(t, axis="tp", dst=1, mesh=MESH)
        r = C.recv((8, 12), torch.float32, axis="tp", src=0, mesh=MESH)
        return C.wait(C.all_reduce(r, axis="tp", mesh=MESH, async_op=True))

    gm = make_fx(f, tracing_mode="fake")(X)
    gm.graph.eliminate_dead_code()
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert names == [
        "shardspec.send.default",
        "shardspec.recv.default",
        "shardspec.all_reduce.default",
        "shardspec.wait.default",
    ]


# Exact ring formulas (docs/guide/performance.md): phi = (n - 1) / n, S in bytes.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_equal_ring_formulas(dtype):
    mesh = Mesh({"dp": 2, "tp": 4}, simulate=True)
    item = torch.empty(0, dtype=dtype).element_size()
    n = 4
    local = [torch.ones(6, 5, dtype=dtype) for _ in range(mesh.size)]
    S = 6 * 5 * item
    with C.count_bytes() as c:
        C.all_reduce(local, axis="tp", mesh=mesh)
    assert c.total_bytes_per_rank == 2 * (n - 1) * S / n and c.by_kind == {"all_reduce": 2 * (n - 1) * S / n}
    with C.count_bytes() as c:
        C.all_gather(local, dim=0, axis="tp", mesh=mesh)  # gathers to n * S total
    assert c.total_bytes_per_rank == (n - 1) * (n * S) // n
    with C.count_bytes() as c:
        C.reduce_scatter([torch.ones(8, 5, dtype=dtype)] * mesh.size, dim=0, axis="tp", mesh=mesh)
    assert c.total_bytes_per_rank == (n - 1) * (8 * 5 * item) // n
    with C.count_bytes() as c:
        C.all_to_all(
            [torch.ones(8, 5, dtype=dtype)] * mesh.size, split_dim=0, concat_dim=1, axis="tp", mesh=mesh
        )
    assert c.total_bytes_per_rank == (n - 1) * (8 * 5 * item) // n
    with C.count_bytes() as c:  # dp x tp: one group of 8
        C.all_reduce(local, axis=("dp", "tp"), mesh=mesh)
    assert c.total_bytes_per_rank == 2 * 7 * S / 8
    with C.count_bytes() as c:
        C.ppermute(local, axis="dp", perm=[(0, 1)], mesh=mesh)
    assert c.bytes_by_rank == {r: (S if mesh.coords(r)["dp"] == 0 else 0) for r in range(8)}


def test_uneven_gather_counts_padded_bytes_and_counters_nest():
    mesh = Mesh({"tp": 4}, simulate=True)
    pieces = [torch.ones(n, 3) for n in (2, 2, 1, 0)]  # global 5 in torch.chunk blocks
    with C.count_bytes() as outer:
        with C.count_bytes() as inner:
            C.all_gather(pieces, dim=0, axis="tp", mesh=mesh, size=5)
        C.all_reduce([torch.ones(2)] * 4, axis="tp", mesh=mesh)
    assert inner.total_bytes_per_rank == 3 * 2 * 3 * 4  # (n-1) x largest block (2 x 3 fp32)
    assert outer.total_bytes_per_rank == 3 * 2 * 3 * 4 + 2 * 3 * 8 / 4
    assert outer.count == 2 and inner.count == 1
    assert inner.records[0].kind == "all_gather" and inner.records[0].group == (0, 1, 2, 3)


def test_size_one_axis_sends_nothing():
    mesh = Mesh({"dp": 1, "tp": 2}, simulate=True)
    with C.count_bytes() as c:
        out = C.all_reduce([torch.ones(3), torch.ones(3)], axis="dp", mesh=mesh)
    assert c.total_bytes_per_rank == 0 and torch.equal(out[0], torch.ones(3))


def test_spmd_violation_is_an_error_not_a_wrong_answer():
    mesh = Mesh({"tp": 2}, simulate=True)

    def body(rank):
        return C.all_gather(torch.ones(2), dim=0, axis="tp", mesh=mesh, size=4 if rank == 0 else None)

    with pytest.raises(ShardingError, match="SPMD violation in all_gather"):
        C.run_simulated(body, mesh)


def test_raising_virtual_rank_aborts_the_others():
    mesh = Mesh({"tp": 4}, simulate=True)

    def body(rank):
        if rank == 2:
            raise RuntimeError("rank 2 broke")
        return C.all_reduce(torch.ones(1), axis="tp", mesh=mesh)

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 broke"):
        C.run_simulated(body, mesh)
    assert time.monotonic() - start < 5


def test_missing_virtual_rank_times_out():
    mesh = Mesh({"tp": 2}, simulate=True)

    def body(rank):
        return C.all_reduce(torch.ones(1), axis="tp", mesh=mesh) if rank == 0 else None

    with pytest.raises(ShardingError, match="timed out after 1 s: a member never arrived"):
        C.run_simulated(body, mesh, timeout=1.0)


def _err(fn) -> str:
    with pytest.raises(ShardingError) as info:
        fn()
    assert "\nFix: " in str(info.value)
    return str(info.value)


def test_error_messages():
    pieces = [torch.ones(2, 2)] * MESH.size
    assert "axis 'pp' is not an axis of dp=2 x tp=4" in _err(
        lambda: C.all_gather(pieces, dim=0, axis="pp", mesh=MESH)
    )
    assert "dim=2 is out of range for a tensor of shape (2, 2)" in _err(
        lambda: C.all_gather(pieces, dim=2, axis="tp", mesh=MESH)
    )
    msg = _err(lambda: C.all_reduce([torch.ones(2, dtype=torch.bool)] * 8, axis="tp", mesh=MESH))
    assert "dtype bool is not supported" in msg and "float32" in msg
    assert "op='avg' on torch.int64" in _err(
        lambda: C.all_reduce([torch.ones(2, dtype=torch.int64)] * 8, axis="tp", mesh=MESH, op="avg")
    )
    assert "op='prod'" in _err(lambda: C.all_reduce(pieces, axis="tp", mesh=MESH, op="prod"))
    assert "got 3 tensors for dp=2 x tp=4 (8 devices)" in _err(
        lambda: C.all_reduce(pieces[:3], axis="tp", mesh=MESH)
    )
    assert "outside a simulated SPMD run" in _err(lambda: C.all_reduce(torch.ones(2), axis="tp", mesh=MESH))
    assert "destination position(s) [1]" in _err(
        lambda: C.ppermute(pieces, axis="tp", perm=[(0, 1), (2, 1)], mesh=MESH)
    )
    assert "outside the group of size 4" in _err(
        lambda: C.ppermute(pieces, axis="tp", perm=[(0, 4)], mesh=MESH)
    )
    assert "src=2 is not a position along ('dp',)" in _err(
        lambda: C.broadcast(pieces, axis="dp", src=2, mesh=MESH)
    )
    assert "different shapes/dtypes" in _err(
        lambda: C.all_reduce([torch.ones(2)] * 7 + [torch.ones(3)], axis="tp", mesh=MESH)
    )
    assert "global size of 9 over 4 devices" in _err(
        lambda: C.all_gather(pieces, dim=0, axis="tp", mesh=MESH, size=9)
    )


def test_zero_dim_tensor_has_no_dim_to_gather():
    msg = _err(lambda: C.all_gather([torch.tensor(1.0)] * 8, dim=0, axis="tp", mesh=MESH))
    assert "0-dim tensor" in msg and "all_reduce" in msg


def test_simulated_send_recv_are_counted_like_real_ones():
    mesh = Mesh({"pp": 2}, simulate=True)

    def body(rank):
        with C.count_bytes() as c:
            if rank == 0:
                C.send(torch.ones(3), axis="pp", dst=1, mesh=mesh)
            else:
                C.recv((3,), torch.float32, axis="pp", src=0, mesh=mesh)
        return [(r.kind, dict(r.bytes_by_rank)) for r in c.records if r.kind in ("send", "recv")]

    sends = [rec for recs in C.run_simulated(body, mesh) for rec in recs]
    assert ("send", {0: 12}) in sends and ("recv", {1: 0}) in sends


def test_a_global_size_is_checked_by_all_to_all_as_a_real_run_does():
    mesh = Mesh({"a": 2}, simulate=True)
    xs = [torch.ones(2, 2), torch.ones(2, 2)]
    assert [t.shape for t in C.all_to_all(xs, split_dim=1, concat_dim=0, axis="a", mesh=mesh, size=4)] == [
        torch.Size([4, 1])
    ] * 2
    with pytest.raises(ShardingError, match=r"lengths \[2, 2\], but a global size of 99"):
        C.all_to_all(xs, split_dim=1, concat_dim=0, axis="a", mesh=mesh, size=99)
    for bad in (-3, 4.0, True):
        with pytest.raises(ShardingError, match="is not a global length"):
            C.all_gather(xs, dim=0, axis="a", mesh=mesh, size=bad)
