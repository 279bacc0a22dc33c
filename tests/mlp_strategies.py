"""Specs of the MLP strategies that the multi-process tests train with."""

from __future__ import annotations

from typing import Any

import torch

from shardspec import P


def specs(strategy: str, opt: Any) -> tuple[dict[str, int], Any, Any, P]:
    rep = {"w1": P(), "b1": P(), "w2": P()}
    if strategy == "dp":
        return {"dp": 4}, rep, opt.state_specs(rep), P("dp")
    if strategy == "zero3":
        split = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
        return {"dp": 4}, split, opt.state_specs(split), P("dp")
    if strategy == "megatron":
        mp = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
        return {"tp": 4}, mp, opt.state_specs(mp), P()
    if strategy == "dp_x_tp":
        mp = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
        return {"dp": 2, "tp": 2}, mp, opt.state_specs(mp), P("dp")
    raise ValueError(strategy)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
