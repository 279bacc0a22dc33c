"""A user-defined custom op, which no sharding rule covers: the stand-in for "an op without a rule"."""

from __future__ import annotations

import torch


@torch.library.custom_op("shardspec_tests::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@doubled.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
