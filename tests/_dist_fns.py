"""Module-level functions that multi-process tests run on every rank (spawned processes import them)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def rank_sum(rank: int, world: int) -> dict[str, object]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": t.item()}


def raise_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the others block here, waiting for rank 1
    return rank


def hang_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(3600)
    return rank


def mesh_groups(rank: int, world: int) -> dict[str, object]:
    """Build a real Mesh (process group already up) and report its per-axis groups."""
    from shardspec import Mesh

    mesh = Mesh({"dp": 2, "tp": 2})
    out: dict[str, object] = {"rank": mesh.rank, "coords": mesh.coords(mesh.rank)}
    for axis in mesh.axis_names:
        group = mesh.device_mesh.get_group(axis)
        out[axis] = dist.get_process_group_ranks(group)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)  # the group really communicates
        out[axis + "_sum"] = t.item()
    return out


def mesh_from_torchrun_env(rank: int, world: int) -> dict[str, object]:
    """No process group yet: Mesh must initialize it from RANK/WORLD_SIZE/MASTER_*."""
    from shardspec import Mesh

    assert not dist.is_initialized()
    mesh = Mesh({"dp": world})
    assert dist.is_initialized()
    result = {
        "backend": dist.get_backend(),
        "rank": mesh.rank,
        "names": mesh.device_mesh.mesh_dim_names,
    }
    dist.destroy_process_group()
    return result


def dtensor_layout_matches(rank: int, world: int) -> list[str]:
    """distribute_tensor with our placements puts on each rank exactly the block our layout says."""
    from torch.distributed.tensor import distribute_tensor

    from shardspec import Mesh, P, device_slices, spec_to_placements

    mesh = Mesh({"dp": 2, "tp": 2})
    checked = []
    for shape, spec in [
        ((8, 6), P("dp", "tp")),
        ((7, 5), P("tp", "dp")),
        ((8, 3), P(("dp", "tp"))),
        ((5, 4), P(None, "dp")),
        ((3, 2), P()),
        ((6,), P("tp")),
    ]:
        x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        dt = distribute_tensor(x, mesh.device_mesh, list(spec_to_placements(spec, mesh, shape)))
        expected = x[device_slices(shape, mesh, spec, rank)]
        assert torch.equal(dt.to_local(), expected), (shape, spec, rank)
        checked.append(f"{shape} {spec}")
    return checked


def run_collective_cases(rank: int, world: int, axes: dict[str, int]) -> dict[str, object]:
    """Run every shared collective case on a real mesh; return this rank's outputs and bytes."""
    import collectives as C
    from shardspec import Mesh
    from tests.collective_cases import call, cases, inputs

    mesh = Mesh(axes)
    outs, sent = [], []
    for case in cases(Mesh(axes, simulate=True)):
        with C.count_bytes() as counter:
            outs.append(call(case, mesh, inputs(case, mesh)[rank]))
        sent.append(counter.total_bytes_per_rank)
    return {"outs": outs, "bytes": sent}


def async_and_p2p(rank: int, world: int) -> dict[str, object]:
    """async_op + wait, send/recv along an axis, on a real 2-rank mesh."""
    import collectives as C
    from shardspec import Mesh

    mesh = Mesh({"pp": world})
    x = torch.full((4, 2), float(rank))
    pending = C.all_gather(x, dim=0, axis="pp", mesh=mesh, async_op=True)
    gathered = C.wait(pending)
    reduced = C.wait(C.all_reduce(x, axis="pp", mesh=mesh, async_op=True))
    if rank == 0:
        C.send(x + 10, axis="pp", dst=1, mesh=mesh)
        got = None
    else:
        got = C.recv((4, 2), torch.float32, axis="pp", src=0, mesh=mesh)
    # two in-place all-reduces of parts of one buffer in flight at once (values a program placed in
    # one held bucket): each is its own pending work, completed by its own wait
    from collectives import distributed

    buf = torch.arange(8.0) * (rank + 1)
    first = torch.ops.shardspec.all_reduce_inplace(buf[:4], axis="pp", mesh=ops_key(mesh), async_op=True)
    second = torch.ops.shardspec.all_reduce_inplace(buf[4:], axis="pp", mesh=ops_key(mesh), async_op=True)
    pending = len(distributed._pending)
    C.wait(second)
    C.wait(first)
    return {"gathered": gathered, "reduced": reduced, "got": got, "pending": pending, "buf": buf}


def ops_key(mesh: object) -> str:
    from collectives import ops

    return ops.mesh_key(mesh)


def pairwise_exchanges(rank: int, world: int) -> dict[str, object]:
    """Async collectives on two-rank gloo groups with tag-0 point-to-point traffic issued while
    they are in flight (a one-axis mesh's group is the world group that send/recv use), counting
    the exchanges posted."""
    import collectives as C
    from collectives import pairwise
    from shardspec import Mesh

    posted = [0]
    post = pairwise._post

    def counting(*args: object) -> object:
        posted[0] += 1
        return post(*args)  # type: ignore[arg-type]

    pairwise._post = counting  # type: ignore[assignment]
    try:
        out: dict[str, object] = {}
        if world == 2:
            mesh = Mesh({"x": 2})
            x = torch.arange(6.0).reshape(3, 2) + 10 * rank
            gathered = C.all_gather(x, dim=1, axis="x", mesh=mesh, async_op=True)
            scattered = C.reduce_scatter(x.t(), dim=0, axis="x", mesh=mesh, async_op=True)
            shifted = C.ppermute(torch.full((5,), float(rank)), axis="x", perm=[(0, 1), (1, 0)], mesh=mesh)
            out.update(gathered=C.wait(gathered), scattered=C.wait(scattered), shifted=shifted)
        else:
            mesh = Mesh({"dp": 2, "tp": 2})
            x = torch.full((4, 2), float(rank))
            out["dp"] = C.wait(C.all_gather(x, dim=0, axis="dp", mesh=mesh, async_op=True))
            out["tp"] = C.wait(C.reduce_scatter(x, dim=0, axis="tp", mesh=mesh, op="max", async_op=True))
            before = posted[0]
            out["both"] = C.all_gather(x, dim=0, axis=("dp", "tp"), mesh=mesh)
            out["four_rank_posted"] = posted[0] - before
        out["posted"] = posted[0]
        return out
    finally:
        pairwise._post = post  # type: ignore[assignment]


def pairwise_edges(rank: int, world: int) -> dict[str, object]:
    """Two-rank exchanges at their edges: the input written into before the wait, empty results in
    flight together, inputs requiring grad, signed zeros under max; then a plain collective after a
    step with a short timeout, reached late by one rank."""
    import collectives as C
    from shardspec import Mesh, P, sharded

    mesh = Mesh({"x": 2})
    out: dict[str, object] = {}
    x = torch.arange(8.0) + 100 * rank
    pending = C.reduce_scatter(x, dim=0, axis="x", mesh=mesh, async_op=True)
    x.zero_()  # read at issue, as the collective's input
    out["written_after_issue"] = C.wait(pending)
    a = C.all_gather(torch.zeros(2, 0), dim=0, axis="x", mesh=mesh, async_op=True)
    c = C.reduce_scatter(torch.zeros(4, 0), dim=0, axis="x", mesh=mesh, async_op=True)
    out["empty"] = (tuple(C.wait(a).shape), tuple(C.wait(c).shape))
    w = torch.ones(4, requires_grad=True)
    out["grad_inputs"] = (
        C.wait(C.all_gather(w, dim=0, axis="x", mesh=mesh, async_op=True)).detach(),
        C.wait(C.reduce_scatter(w, dim=0, axis="x", mesh=mesh, async_op=True)).detach(),
    )
    z = torch.tensor([-0.0, 0.0, 0.0, -0.0]) if rank == 0 else torch.tensor([0.0, -0.0, -0.0, 0.0])
    out["max_zeros"] = C.reduce_scatter(z, dim=0, axis="x", mesh=mesh, op="max")
    # along dim 1: dense results, issued without waiting for a peer that comes late
    if rank == 1:
        time.sleep(1.0)
    y = torch.arange(6.0).reshape(2, 3) + 10 * rank
    t0 = time.monotonic()
    gathered = C.all_gather(y, dim=1, axis="x", mesh=mesh, size=6, async_op=True)
    scattered = C.reduce_scatter(torch.ones(2, 4), dim=1, axis="x", mesh=mesh, async_op=True)
    out["dim1_issue_s"] = time.monotonic() - t0
    out["dim1"] = (C.wait(gathered), C.wait(scattered))
    step = sharded(lambda t: t * 2, mesh=mesh, in_specs=(P(),), out_specs=P(), timeout=1.0)
    step(torch.ones(2))
    if rank == 1:
        time.sleep(2.0)  # longer than the step's timeout, which ended with the step
    out["after_step"] = C.all_gather(torch.full((1,), float(rank)), dim=0, axis="x", mesh=mesh)
    return out


def attention_after_last_dim_gathers(rank: int, world: int) -> list[float]:
    """Fused CPU attention reading operands all-gathered along their last dim (a head-dim split; a
    column-parallel qkv split into q, k, v): |sharded - eager| per result. The real all-gather
    returned a strided view where the compiled program expected dense rows."""
    import optree
    import torch.nn.functional as F

    import shardspec
    from shardspec import Mesh, P, sharded

    mesh = Mesh({"tp": world})
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 4, generator=g) for _ in range(3))
    head_dim = P(None, None, None, "tp")
    attend = sharded(F.scaled_dot_product_attention, mesh=mesh, in_specs=(head_dim,) * 3, out_specs=P())
    errors = [float((attend(q, k, v).full_tensor() - F.scaled_dot_product_attention(q, k, v)).abs().max())]
    b, t, d, heads = 2, 4, 8, 2
    params = {
        "c_attn": torch.randn(3 * d, d, generator=g) * 0.3,
        "c_proj": torch.randn(d, d, generator=g) * 0.3,
    }
    x = torch.randn(b, t, d, generator=g)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, p["c_attn"]).split(d, dim=2)
        q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = F.linear(y.transpose(1, 2).reshape(b, t, d), p["c_proj"])
        return (y * y).mean()

    def step(p: dict[str, torch.Tensor], x: torch.Tensor) -> object:
        return shardspec.value_and_grad(loss)(p, x)

    specs = {"c_attn": P("tp"), "c_proj": P(None, "tp")}
    got = sharded(step, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs))(params, x)
    for a, w in zip(optree.tree_leaves(got), optree.tree_leaves(step(params, x)), strict=True):
        errors.append(float((a.full_tensor() - w).abs().max()))
    return errors


def review_regressions(rank: int, world: int) -> dict[str, object]:
    """Edge cases found in review: empty gathers, odd strides, p2p over an axis tuple first."""
    import collectives as C
    from shardspec import Mesh, ShardingError

    mesh = Mesh({"a": 2, "b": 2})
    out: dict[str, object] = {}
    # p2p over a tuple of axes before any collective on that tuple (no lazy group creation)
    if rank == 0:
        C.send(torch.full((2,), 7.0), axis=("a", "b"), dst=3, mesh=mesh)
    if rank == 3:
        out["recv"] = C.recv((2,), torch.float32, axis=("a", "b"), src=0, mesh=mesh)
    out["empty"] = C.all_gather(torch.zeros(0, 3), dim=0, axis="b", mesh=mesh)
    base = torch.arange(6.0).reshape(2, 3) + rank
    odd = base if rank % 2 == 0 else base.t().contiguous().t()  # same values, column-major
    out["all_reduce"] = C.all_reduce(odd, axis="b", mesh=mesh)
    out["broadcast"] = C.broadcast(odd, axis="b", src=1, mesh=mesh)
    out["ppermute"] = C.ppermute(odd, axis="b", perm=[(0, 1), (1, 0)], mesh=mesh)
    try:
        C.all_gather(torch.zeros(2, 3), dim=0, axis="b", mesh=mesh, size=9)  # 5 + 4: no member has 2
    except ShardingError as e:
        out["size_error"] = str(e)
    # an async reduce-scatter of an input requiring grad over the four ranks (c10d's collective):
    # its result was a view of the output buffer, which autograd refused at the wait
    w = torch.ones(8, requires_grad=True)
    out["grad_rs"] = C.wait(C.reduce_scatter(w, dim=0, axis=("a", "b"), mesh=mesh, async_op=True)).detach()
    return out


def train_mlp_steps(rank: int, world: int, strategy: str, steps: int) -> dict[str, object]:
    """Run ``steps`` AdamW steps of the example MLP under a strategy's specs on a real mesh."""
    import collectives as C
    from examples.models import mlp
    from shardspec import Mesh, P, optim, sharded
    from tests.mlp_strategies import batch, specs

    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    step = mlp.make_step(opt)
    axes, pspec, sspec, bspec = specs(strategy, opt)
    mesh = Mesh(axes)
    params = mlp.init(8, 16, 4)
    state = opt.init(params)
    f = sharded(step, mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P()))
    losses, sent, planned = [], [], []
    for i in range(steps):
        x, y = batch(i)
        planned.append(f.lower(params, state, x, y).cost().comm_bytes_per_rank)
        with C.count_bytes() as counter:
            params, state, loss = f(params, state, x, y)  # DTensors from step 2 on
        sent.append(counter.total_bytes_per_rank)
        losses.append(loss.full_tensor())
    return {
        "losses": losses,
        "params": {k: v.full_tensor() for k, v in params.items()},
        "sent": sent,
        "planned": planned,
        "local_w1": tuple(params["w1"].to_local().shape),
    }


def uneven_rejected_and_rank_dependent_program(rank: int, world: int) -> dict[str, str]:
    """Real-mode errors: a layout DTensor cannot hold; ranks that compiled different programs."""
    from shardspec import Mesh, P, ShardingError, sharded

    mesh = Mesh({"dp": 2, "tp": 2})
    out: dict[str, str] = {}
    f = sharded(lambda x: x * 2, mesh=mesh, in_specs=(P(("dp", "tp")),), out_specs=P(("dp", "tp")))
    try:
        f(torch.ones(6, 3))  # 6 over dp x tp: flat blocks 2,2,2,0; DTensor would nest 3 -> (2,1)
    except ShardingError as e:
        out["uneven"] = str(e)
    g = sharded(lambda x: x.sum(0), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    try:
        g(torch.ones(8 if rank == 0 else 4, 3))  # a rank-dependent global shape
    except ShardingError as e:
        out["signature"] = str(e)
    # same arguments everywhere, but a rank-dependent spec: the programs' collectives differ
    h = sharded(lambda x: x.sum(0), mesh=mesh, in_specs=(P("dp"),), out_specs=P() if rank == 0 else P("tp"))
    try:
        h(torch.ones(8, 4))
    except ShardingError as e:
        out["hash"] = str(e)
    return out


def to_global_snapshot_then_donate(rank: int, world: int) -> dict[str, bool]:
    """A replicated result's to_global() kept across a step that donates that result: the kept
    value must not change (full_tensor() of a replicated DTensor is its local tensor itself)."""
    import shardspec
    from shardspec import Mesh, P, optim, sharded, to_global

    opt = optim.sgd(lr=0.5)

    def step(params, state, x):
        loss, grads = shardspec.value_and_grad(lambda p, x: ((x @ p["w"]) ** 2).mean())(params, x)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    mesh = Mesh({"dp": world})
    f = sharded(step, mesh=mesh, in_specs=(P(), P(), P("dp")), out_specs=(P(), P(), P()), donate=(0, 1))
    g = torch.Generator().manual_seed(0)
    params, x = {"w": torch.randn(4, 4, generator=g)}, torch.randn(8, 4, generator=g)
    state = opt.init(params)
    params, state, _ = f(params, state, x)
    snap = to_global(params)["w"]
    kept = snap.clone()
    params, state, _ = f(params, state, x)  # donates the parameters the snapshot was taken of
    return {"unchanged": torch.equal(snap, kept), "moved_on": not torch.equal(to_global(params)["w"], kept)}
