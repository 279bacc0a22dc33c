"""The two sides of each comparison: the example GPT trained by a shardspec step and by its
torch-native equivalent (eager, DDP, FSDP2, DTensor tensor parallel), with the same AdamW.

Both sides start from ``gpt.init`` with the same seed and see the same batch, so their first losses
must agree; every step reuses the same batch (the timing is what matters, not convergence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardspec
from examples.models import gpt
from shardspec import Mesh, P, optim, sharded

# eps=1e-6: GPT's key bias has an exactly zero true gradient, so its computed gradient is rounding
# noise that AdamW with eps=1e-8 turns into lr-sized updates differing between summation orders.
HYPER: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}
STRATEGIES = ("dp", "zero3", "tp")

# Megatron layout: column-parallel in-projections (rows split), row-parallel out-projections.
COLUMN = ("attn.qkv.weight", "mlp.fc.weight")
COLUMN_BIAS = ("attn.qkv.bias", "mlp.fc.bias")
ROW = ("attn.proj.weight", "mlp.proj.weight")


@dataclass
class Side:
    """One way of running the training step on this rank."""

    step: Callable[[], torch.Tensor]  # one training step on the fixed batch; this rank's loss
    global_loss: Callable[[torch.Tensor], float]  # the batch-mean loss (may communicate)
    state_bytes: Callable[[], int]  # parameters + optimizer state this rank holds
    info: dict[str, Any] = field(default_factory=dict)  # shardspec: the plan from lower().cost()


def make_batch(cfg: gpt.Config, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    return tok, tgt


def held_bytes(tensors: Any) -> int:
    """Bytes of the storages this rank's blocks of ``tensors`` keep alive, each storage once: a
    block that is a view of a larger buffer counts the whole buffer (what it really holds)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def param_specs(strategy: str, params: dict[str, torch.Tensor], world: int) -> dict[str, P]:
    """dp / single: replicated; zero3: dim 0 over dp where it divides evenly (DTensor cannot hold
    uneven real layouts); tp: Megatron column/row splits of the attention and MLP projections."""
    if strategy == "zero3":
        return {k: P("dp") if v.shape[0] % world == 0 else P() for k, v in params.items()}
    if strategy == "tp":
        specs = {}
        for k in params:
            if k.endswith(COLUMN):
                specs[k] = P("tp", None)
            elif k.endswith(COLUMN_BIAS):
                specs[k] = P("tp")
            elif k.endswith(ROW):
                specs[k] = P(None, "tp")
            else:
                specs[k] = P()
        return specs
    return {k: P() for k in params}


def shardspec_side(
    strategy: str, cfg: gpt.Config, world: int, batch: tuple[torch.Tensor, ...], backend: str = "eager"
) -> Side:
    """A ``@sharded`` step (forward, backward, AdamW as one program); the batch is pre-placed as
    DTensors so neither side pays for slicing it inside the timed step."""
    from torch.distributed.tensor import DTensor

    from shardspec import spec_to_placements
    from shardspec.layout import device_slices

    axis = "tp" if strategy == "tp" else "dp"
    mesh = Mesh({axis: world})
    opt = optim.adamw(**HYPER)
    params = gpt.init(cfg)
    pspec = param_specs(strategy, params, world)
    sspec = opt.state_specs(pspec)
    bspec = P() if strategy == "tp" else P("dp")

    def loss_fn(p: dict[str, torch.Tensor], tok: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return gpt.loss_fn(p, tok, tgt, cfg)

    def train_step(p: Any, s: Any, tok: torch.Tensor, tgt: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(loss_fn)(p, tok, tgt)
        p, s = opt.update(grads, s, p)
        return p, s, loss

    # donated, as torch.optim updates in place: parameters and moments are updated where they lie
    f = sharded(
        train_step,
        mesh=mesh,
        in_specs=(pspec, sspec, bspec, bspec),
        out_specs=(pspec, sspec, P()),
        donate=(0, 1),
        backend=backend,
    )
    placed = [
        DTensor.from_local(
            x[device_slices(tuple(x.shape), mesh, bspec, mesh.rank)].contiguous(),
            mesh.device_mesh,
            list(spec_to_placements(bspec, mesh, tuple(x.shape))),
            run_check=False,
        )
        for x in batch
    ]
    live: list[Any] = [params, opt.init(params)]
    import time

    t0 = time.perf_counter()
    lowered = f.lower(live[0], live[1], *placed)  # compiles: kept out of every timed step
    cost = lowered.cost()
    info = {
        "compile_s": time.perf_counter() - t0,
        "launches": cost.collective_count,
        "bytes": cost.comm_bytes_per_rank,
        "bytes_by_kind": dict(cost.bytes_by_kind),
        "launches_by_kind": _count_kinds([c.kind for c in lowered.collectives()]),  # per tensor
        "planned_peak_bytes": cost.peak_memory_bytes_per_rank,
    }

    def step() -> torch.Tensor:
        live[0], live[1], loss = f(live[0], live[1], *placed)
        return loss  # type: ignore[no-any-return]

    def global_loss(loss: torch.Tensor) -> float:
        return float(loss.to_local().item()) if isinstance(loss, DTensor) else float(loss.item())

    def state_bytes() -> int:
        import optree

        leaves: list[Any] = optree.tree_leaves(cast(Any, live), none_is_leaf=False)
        return held_bytes(leaves)

    return Side(step, global_loss, state_bytes, info)


def _count_kinds(kinds: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in kinds:
        out[k] = out.get(k, 0) + 1
    return out


class LocalHeadsAttention(gpt.Attention):
    """``gpt.Attention`` on this rank's heads: after ColwiseParallel the qkv output holds
    heads / tp heads (head-major rows), and the row-parallel projection takes d / tp features —
    the per-rank head count Megatron-style TP needs, since the module's view and reshape use it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = gpt.split_heads(self.qkv(x), self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


def _tp_model(model: gpt.GPT, cfg: gpt.Config, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {}
    for i, blk in enumerate(model.h):
        local = LocalHeadsAttention(cfg)
        local.load_state_dict(cast(nn.Module, blk.attn).state_dict())
        local.heads = cfg.heads // world
        blk.attn = local
        plan.update(
            {
                f"h.{i}.attn.qkv": ColwiseParallel(),
                f"h.{i}.attn.proj": RowwiseParallel(),
                f"h.{i}.mlp.fc": ColwiseParallel(),
                f"h.{i}.mlp.proj": RowwiseParallel(),
            }
        )
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, plan)


def torch_side(strategy: str, cfg: gpt.Config, world: int, batch: tuple[torch.Tensor, ...]) -> Side:
    """The ``nn.Module`` GPT with ``torch.optim.AdamW``: eager (world 1), DDP (dp), FSDP2
    ``fully_shard`` per block and root (zero3), or DTensor ``parallelize_module`` (tp)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model: nn.Module = gpt.GPT(cfg)
    model.load_state_dict(gpt.init(cfg))
    tok, tgt = batch
    data_parallel = strategy in ("dp", "zero3") and world > 1
    if data_parallel:
        tok, tgt = tok.chunk(world)[rank].contiguous(), tgt.chunk(world)[rank].contiguous()
    if strategy == "dp" and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif strategy == "zero3" and world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for blk in model.h:  # type: ignore[union-attr]
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif strategy == "tp" and world > 1:
        assert isinstance(model, gpt.GPT)
        model = _tp_model(model, cfg, world)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        logits = model(tok)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return loss.detach()

    def global_loss(loss: torch.Tensor) -> float:
        if data_parallel:  # equal token counts per rank: the mean of rank means is the batch mean
            loss = loss.clone()
            dist.all_reduce(loss)
            return float(loss.item()) / world
        return float(loss.item())

    def state_bytes() -> int:
        return held_bytes([*model.parameters(), *(t for s in opt.state.values() for t in s.values())])

    return Side(step, global_loss, state_bytes)
