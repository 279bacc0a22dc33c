"""A residual MLP of ``layers`` blocks with a pipeline boundary after each: the model the pipeline
tests and ``benchmarks/pipeline_bubble.py`` use (balanced: every block costs the same)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import shardspec
from shardspec import P, optim


def init(layers: int, d: int, hidden: int, classes: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks": [
            {
                "w1": torch.randn(d, hidden, generator=g) / d**0.5,
                "b1": torch.randn(hidden, generator=g) * 0.1,
                "w2": torch.randn(hidden, d, generator=g) / hidden**0.5,
            }
            for _ in range(layers)
        ],
        "head": torch.randn(d, classes, generator=g) / d**0.5,
    }


def _block(h: torch.Tensor, blk: dict[str, torch.Tensor]) -> torch.Tensor:
    return h + F.gelu(h @ blk["w1"] + blk["b1"]) @ blk["w2"]


def forward(
    params: dict[str, Any], x: torch.Tensor, boundaries: bool = True, remat: bool = False
) -> torch.Tensor:
    """``remat``: each block under ``shardspec.remat`` (recomputed for backward)."""
    block = shardspec.remat(_block) if remat else _block
    h = x
    for i, blk in enumerate(params["blocks"]):
        if i and boundaries:
            h = shardspec.pipeline_boundary(h)
        h = block(h, blk)
    out: torch.Tensor = h @ params["head"]
    return out


def loss_fn(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor, remat: bool = False) -> torch.Tensor:
    return F.cross_entropy(forward(params, x, remat=remat), y)


def make_step(microbatches: int, opt: Any = None, remat: bool = False) -> Any:
    opt = opt or optim.adamw(lr=1e-2, weight_decay=0.1)

    def step(params: Any, state: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(loss_fn, microbatches=microbatches)(params, x, y, remat)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    return step


def specs(params: dict[str, Any], tp: bool, dp: bool, opt: Any) -> tuple[Any, Any, P, P]:
    """Megatron splits over ``tp`` when asked, the batch over ``dp``; the pipeline axis in none."""
    blk = (
        {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)} if tp else {"w1": P(), "b1": P(), "w2": P()}
    )
    pspec = {"blocks": [dict(blk) for _ in params["blocks"]], "head": P()}
    batch = P("dp") if dp else P()
    return pspec, opt.state_specs(pspec), batch, P("dp") if dp else P()


def data(batch: int, d: int, classes: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)
