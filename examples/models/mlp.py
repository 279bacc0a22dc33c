"""A two-layer MLP classifier as a pure function over a parameter dict, and its AdamW training step."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import shardspec
from shardspec import optim


def init(d_in: int, d_hidden: int, d_out: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(d_in, d_hidden, generator=g) / d_in**0.5,
        "b1": torch.zeros(d_hidden),
        "w2": torch.randn(d_hidden, d_out, generator=g) / d_hidden**0.5,
    }


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ params["w1"] + params["b1"])
    return F.cross_entropy(h @ params["w2"], y)


def make_step(opt: Any = None) -> Any:
    opt = opt or optim.adamw(lr=1e-2, weight_decay=0.1)

    def step(params: Any, state: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(loss_fn)(params, x, y)
        params, state = opt.update(grads, state, params)
        return params, state, loss

    return step
