"""A small transformer classifier written with einops, as much published model code is: ``rearrange``
splits heads and patches, ``reduce`` pools, ``einsum`` scores attention. Pure functions over a
parameter dict.

The qkv projection is head-major (rows laid out as heads x (q, k, v) x head_dim), so splitting its
rows over a tensor-parallel axis splits heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, reduce


@dataclass(frozen=True)
class Config:
    image: int = 8  # square images of image x image pixels, 1 channel
    patch: int = 2
    d: int = 16
    heads: int = 4
    layers: int = 2
    classes: int = 10


def init(cfg: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    params = {
        "patch.weight": w(cfg.d, cfg.patch * cfg.patch),
        "pos": w((cfg.image // cfg.patch) ** 2, cfg.d),
        "head.weight": w(cfg.classes, cfg.d),
    }
    for i in range(cfg.layers):
        params |= {
            f"blocks.{i}.norm.weight": torch.ones(cfg.d),
            f"blocks.{i}.qkv.weight": w(3 * cfg.d, cfg.d),
            f"blocks.{i}.out.weight": w(cfg.d, cfg.d),
            f"blocks.{i}.fc1.weight": w(4 * cfg.d, cfg.d),
            f"blocks.{i}.fc2.weight": w(cfg.d, 4 * cfg.d),
        }
    return params


def attention(p: dict[str, torch.Tensor], pre: str, x: torch.Tensor, heads: int) -> torch.Tensor:
    qkv = F.linear(x, p[pre + "qkv.weight"])
    q, k, v = rearrange(qkv, "b s (h three e) -> three b h s e", h=heads, three=3)
    scores = einsum(q, k, "b h i e, b h j e -> b h i j") * q.shape[-1] ** -0.5
    y = einsum(scores.softmax(dim=-1), v, "b h i j, b h j e -> b h i e")
    return F.linear(rearrange(y, "b h s e -> b s (h e)"), p[pre + "out.weight"])


def forward(p: dict[str, torch.Tensor], images: torch.Tensor, cfg: Config) -> torch.Tensor:
    patches = rearrange(images, "b (y py) (x px) -> b (y x) (py px)", py=cfg.patch, px=cfg.patch)
    x = F.linear(patches, p["patch.weight"]) + p["pos"]
    for i in range(cfg.layers):
        pre = f"blocks.{i}."
        h = F.rms_norm(x, (cfg.d,), p[pre + "norm.weight"])
        x = x + attention(p, pre, h, cfg.heads)
        x = x + F.linear(F.gelu(F.linear(x, p[pre + "fc1.weight"])), p[pre + "fc2.weight"])
    return F.linear(reduce(x, "b s d -> b d", "mean"), p["head.weight"])


def loss_fn(
    p: dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor, cfg: Config
) -> torch.Tensor:
    return F.cross_entropy(forward(p, images, cfg), labels)
