"""Checkpoint test helpers: MLP training phases that resume from and save checkpoints on a mesh.

A phase runs on every rank of a real mesh (``run_distributed``) or, for ``sim_*`` layouts, once in the
calling process on a simulated mesh; either way it returns global tensors so tests compare them with
an uninterrupted single-process run.
"""

from __future__ import annotations

from typing import Any

import torch

from examples.models import mlp
from shardspec import Mesh, P, checkpoint, optim, sharded
from tests.mlp_strategies import batch

OPT = optim.adamw(lr=1e-2, weight_decay=0.1)
SIZES = (8, 16, 4)
_REP = {"w1": P(), "b1": P(), "w2": P()}
_TP = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
_ZERO3 = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
LAYOUTS: dict[str, tuple[dict[str, int], dict[str, P], P]] = {
    "dp4": ({"dp": 4}, _REP, P("dp")),
    "zero3": ({"dp": 4}, _ZERO3, P("dp")),
    "dp2xtp2": ({"dp": 2, "tp": 2}, _TP, P("dp")),
    "tp2": ({"tp": 2}, _TP, P()),
    "tp4": ({"tp": 4}, _TP, P()),
    "sim_zero3": ({"dp": 4}, _ZERO3, P("dp")),
}


def _full(x: Any) -> torch.Tensor:
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def fresh() -> dict[str, Any]:
    """The tree a run checkpoints: parameters, AdamW state and a Python scalar."""
    params = mlp.init(*SIZES)
    return {"params": params, "opt": OPT.init(params), "model": "mlp"}


def reference(steps: int) -> dict[str, torch.Tensor]:
    """Uninterrupted unsharded training in this process."""
    step = mlp.make_step(OPT)
    tree = fresh()
    params, state = tree["params"], tree["opt"]
    for i in range(steps):
        params, state, _ = step(params, state, *batch(i))
    return params


def train_phase(
    rank: int, world: int, layout: str, ckpt: str, start: int, stop: int, save: bool
) -> dict[str, Any]:
    """Resume from ``ckpt`` at ``start`` (unless 0), train to ``stop`` on ``layout``, maybe save."""
    axes, pspec, bspec = LAYOUTS[layout]
    mesh = Mesh(axes, simulate=layout.startswith("sim_"))
    sspec = OPT.state_specs(pspec)
    tree = fresh()
    out: dict[str, Any] = {}
    if start:
        specs = {"params": pspec, "opt": sspec, "model": P()}
        tree, step = checkpoint.load(ckpt, like=tree, mesh=mesh, specs=specs, restore_rng=True)
        assert step == start and tree["model"] == "mlp", (step, tree["model"])
        out["loaded"] = {k: _full(v) for k, v in tree["params"].items()}
        out["rng_after_load"] = torch.rand(3)
        if not mesh.simulated:
            out["local_w1"] = tuple(tree["params"]["w1"].to_local().shape)
    f = sharded(
        mlp.make_step(OPT), mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P())
    )
    params, state = tree["params"], tree["opt"]
    for i in range(start, stop):
        params, state, _ = f(params, state, *batch(i))
    if save:
        torch.manual_seed(1000 + rank)
        checkpoint.save(ckpt, {"params": params, "opt": state, "model": "mlp"}, step=stop)
        out["rng_after_save"] = torch.rand(3)
    out["params"] = {k: _full(v) for k, v in params.items()}
    return out


def disagreements(rank: int, world: int, root: str) -> dict[str, str]:
    """Ranks that pass different things to save/load get the same ShardingError, never a hang."""
    from shardspec import ShardingError

    def message(fn: Any) -> str:
        try:
            fn()
        except ShardingError as exc:
            return str(exc)
        return "no error"

    same = {"w": torch.ones(4)}
    out = {
        "step": message(lambda: checkpoint.save(root, same, step=1 + rank)),
        "shape": message(lambda: checkpoint.save(root, {"w": torch.ones(4 + rank)}, step=1)),
        "keys": message(
            lambda: checkpoint.save(root, {"w": torch.ones(4), **({"y": 1} if rank else {})}, step=1)
        ),
        "values": message(lambda: checkpoint.save(root, {"w": torch.full((4,), float(rank))}, step=1)),
    }
    checkpoint.save(root, same, step=2)
    like = {"w": torch.empty(4)} if rank == 0 else {"v": torch.empty(4)}
    out["load"] = message(lambda: checkpoint.load(root, like=like))
    out["loaded"] = str(checkpoint.load(root, like=same).step)
    # the same mistake on every rank is raised on every rank too (it once passed silently)
    out["all dtype"] = message(
        lambda: checkpoint.load(root, like={"w": torch.empty(4, dtype=torch.bfloat16)})
    )
    out["all missing"] = message(lambda: checkpoint.load(root, like={}))
    out["all save"] = message(lambda: checkpoint.save(root, {"w": object()}, step=3))
    # a damaged shard file that only rank 1 wrote (and rank 0 checks when loading): every rank
    # raises the same error, never a silent load of wrong values on some ranks
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    mesh = Mesh({"dp": world})
    rows = DTensor.from_local(torch.full((2, 3), 1.0 + rank), mesh.device_mesh, [Shard(0)])
    ckpt = checkpoint.save(root, {"rows": rows}, step=4)
    if rank == 0:
        shard = ckpt / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[data.find(torch.full((3,), 2.0).numpy().tobytes())] ^= 0x10
        shard.write_bytes(bytes(data))
    dist.barrier()
    out["damaged"] = message(
        lambda: checkpoint.load(root, like={"rows": rows}, mesh=mesh, specs={"rows": P("dp")})
    )
    return out
