"""Rank functions for the real-mode input-contract tests (module level: worker processes import them)."""

from __future__ import annotations

import time
from typing import Any

import torch


def _message(fn: Any) -> str:
    from shardspec import ShardingError

    try:
        fn()
    except ShardingError as exc:
        return str(exc)
    return "no error"


def contract_checks(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from shardspec import Mesh, P, from_local, sharded

    mesh = Mesh({"dp": world})
    full_x = torch.arange(16.0).reshape(4, 4)
    w = torch.linspace(-1, 1, 4)

    def loss(w: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x @ w).sum() * scale

    step = sharded(loss, mesh=mesh, in_specs=(P(), P("dp"), P()), out_specs=P())
    out: dict[str, Any] = {}
    mine = full_x.chunk(world)[rank]
    # the DDP habit: each rank passes its own slice as a plain tensor
    out["ddp_habit"] = _message(lambda: step(w, mine, 1.0))
    # the same data, declared rank-local
    out["from_local"] = step(w, from_local(mine, P("dp"), mesh), 1.0).full_tensor()
    out["reference"] = loss(w, full_x, 1.0)
    # replicated parameters initialised differently on each rank
    out["seeds"] = _message(lambda: step(w + rank, full_x, 2.0))
    # a rank-dependent Python scalar
    out["scalar"] = _message(lambda: step(w, full_x, 1.0 + rank))
    # a DTensor on a device grid with the same dim names but other ranks
    other = DeviceMesh("cpu", list(reversed(range(world))), mesh_dim_names=("dp",))
    dx = distribute_tensor(full_x, other, [Replicate()])
    out["grid"] = _message(lambda: step(w, dx, 1.0))
    # the same grid, its axis named otherwise (another step's result)
    named = DeviceMesh("cpu", list(range(world)), mesh_dim_names=("ep",))
    out["names"] = _message(lambda: step(w, distribute_tensor(full_x, named, [Replicate()]), 1.0))
    # ranks call different steps with the same argument shapes
    twice = sharded(lambda x: (x * 2).sum(), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    thrice = sharded(lambda x: (x * 3).sum(), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    twice(full_x), thrice(full_x)
    out["steps"] = _message(lambda: twice(full_x) if rank == 0 else thrice(full_x))
    # a replicated block that differs across the ranks holding it
    out["replica"] = _message(lambda: from_local(torch.full((4,), float(rank)), P(), mesh))
    # a DTensor on the first call does not exempt later plain-tensor calls from the value check
    total = sharded(lambda x: x.sum(0), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    total(from_local(mine, P("dp"), mesh))
    out["later_plain"] = _message(lambda: total(full_x + 100 * rank))
    # a tensor the step closes over that differs across ranks
    mine_const = torch.full((4,), rank + 1.0)
    closure = sharded(lambda x: (x @ mine_const).sum(), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    out["closure"] = _message(lambda: closure(full_x))

    # one function, two steps: a closure constant (a learning rate) or the specs differ per rank
    def scaled(lr: float) -> Any:
        return sharded(lambda x: (x * lr).sum(), mesh=mesh, in_specs=(P("dp"),), out_specs=P())

    out["closure_scalar"] = _message(lambda: scaled(0.1 * (rank + 1))(full_x))
    specs = (P("dp"),) if rank == 0 else (P(None, "dp"),)
    out["specs"] = _message(
        lambda: sharded(lambda x: x * 2, mesh=mesh, in_specs=specs, out_specs=P())(full_x)
    )
    # one rank passes a DTensor, the other the plain full tensor
    local = from_local(mine, P("dp"), mesh)  # (a collective: every rank builds it)
    dtensor_or_plain = local if rank == 0 else full_x
    out["dtensor_or_plain"] = _message(lambda: total(dtensor_or_plain))
    # a learning rate passed as a 0-dim tensor (not to recompile per value), differing on a later call
    sgd = sharded(lambda w, lr: w - lr * w, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    sgd(w, torch.tensor(0.1)), sgd(w, torch.tensor(0.1))  # the first calls agree (and are value-checked)
    out["tensor_lr"] = _message(lambda: sgd(w, torch.tensor(0.1 * (rank + 1))))
    # one rank alone changes a shape on a later call
    x = full_x if rank == 0 else torch.cat([full_x, full_x])
    out["shape"] = _message(lambda: step(w, x, 1.0))
    # rank 1 alone passes a tree its in_specs do not match: it raises when compiling, and rank 0 is
    # told at once (within the timeout's fraction), not after waiting the whole timeout for it
    tree = sharded(
        lambda p, x: x @ p["w"], mesh=mesh, in_specs=({"w": P()}, P("dp")), out_specs=P("dp"), timeout=60
    )
    p = {"w": torch.ones(4, 4)} if rank == 0 else {"w": torch.ones(4, 4), "extra": torch.zeros(1)}
    t0 = time.monotonic()
    out["tree"] = _message(lambda: tree(p, full_x))
    out["tree_s"] = time.monotonic() - t0
    # rank 1 never calls: rank 0 gets an error after the timeout, not a hang
    lonely = sharded(loss, mesh=mesh, in_specs=(P(), P("dp"), P()), out_specs=P(), timeout=2.0)
    if rank == 0:
        out["absent"] = _message(lambda: lonely(w, full_x, 1.0))
    else:
        time.sleep(4.0)
    return out


def one_rank_raises(rank: int, world: int, uneven: bool) -> str:
    """Rank 1's program raises before its first collective (its own data indexes out of range);
    rank 0 waits for that collective: an error at the step's timeout, not a hang. Even blocks: an
    async reduction and its wait; uneven ones (3 rows over 2 ranks): a synchronous all-gather."""
    from shardspec import Mesh, P, from_local, sharded

    mesh = Mesh({"dp": world})
    fn = (lambda w, i: w[i] * 2) if uneven else (lambda w, i: w[i].sum())
    step = sharded(fn, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P(), timeout=3.0)
    w = torch.arange(10.0)
    if uneven:
        step(w, torch.tensor([1, 2, 3]))  # compiled and agreed on by both
        index = torch.tensor([1, 2, 99])  # the same global value; rank 1's block holds 99
    else:
        step(w, from_local(torch.tensor([1, 2]), P("dp"), mesh))
        index = from_local(torch.tensor([1, 2] if rank == 0 else [1, 99]), P("dp"), mesh)
    try:
        step(w, index)
    except Exception as exc:  # rank 0: ShardingError; rank 1: torch's IndexError
        return str(exc)
    return "no error"


def raise_then_call_again(rank: int, world: int) -> list[str]:
    """A bad id on rank 1 only (embedding raises there); each rank then calls the step again, as a
    loop that skips a bad batch would. Rank 0 waits in the first call's collective until the
    timeout; the second call must be an error on both ranks, not a gloo abort on the mismatch."""
    import tempfile

    import torch.nn.functional as F

    from shardspec import Mesh, P, checkpoint, from_local, sharded, to_global

    mesh = Mesh({"dp": world})
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    step = sharded(
        lambda w, i: F.embedding(i, w).sum(), mesh=mesh, in_specs=(P(), P("dp")), out_specs=P(), timeout=5
    )
    block = from_local(torch.ones(2), P("dp"), mesh)
    out = []
    for ids in (torch.tensor([0, 5, 6, 2]), torch.tensor([0, 5, 5, 2])):  # 6 is out of range: rank 1's
        try:
            step(w, ids)
            out.append("ok")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc} {getattr(exc, '__notes__', '')}")
    # the other collectives of the public API are refused the same way, at once
    for call in (
        lambda: to_global(block),
        lambda: from_local(torch.ones(2), P("dp"), mesh),
        lambda: checkpoint.save(tempfile.mkdtemp(), {"x": block}, step=1),
        lambda: checkpoint.load(tempfile.mkdtemp(), like={"x": block}, mesh=mesh),
    ):
        try:
            call()
            out.append("ok")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def late_for_the_agreement_check(rank: int, world: int) -> list[str]:
    """Rank 1 comes to the second call after the step's timeout: rank 0's agreement check times out
    and stays posted, so rank 0's retry must be refused at once, not wait out the timeout again
    (nor pair with rank 1's late check)."""
    from shardspec import Mesh, P, sharded

    mesh = Mesh({"dp": world})
    step = sharded(lambda w: w * 2, mesh=mesh, in_specs=(P(),), out_specs=P(), timeout=1.0)
    step(torch.ones(2))
    out = []
    if rank == 1:
        time.sleep(2.5)
        return out
    for _ in range(2):
        t0 = time.monotonic()
        try:
            step(torch.ones(2))
            out.append("ok")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc} ({time.monotonic() - t0:.1f} s)")
    return out


def raise_with_different_arguments(rank: int, world: int) -> list[str]:
    """Rank 1 passes other ids (so the call's agreement check fails on every rank) and its own
    are out of range: its error comes before the check completes. Nothing is left waiting, so the
    next call must run on both ranks."""
    from shardspec import Mesh, P, sharded

    mesh = Mesh({"dp": world})
    e, x = torch.randn(10, 8), torch.zeros(4, 8)
    step = sharded(
        lambda e, x, ids: (x + e[ids].sum(0)).sum(),
        mesh=mesh,
        in_specs=(P(), P("dp"), P()),
        out_specs=P(),
        timeout=20,
    )
    out = []
    bad = torch.tensor([1, 12]) if rank == 1 else torch.tensor([1, 3])  # small CPU values differ
    for ids in (torch.tensor([1, 2]), bad, torch.tensor([1, 2])):
        try:
            step(e, x, ids)
            out.append("ok")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out
