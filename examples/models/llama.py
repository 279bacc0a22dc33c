"""A small Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, no biases), as pure functions
over a parameter tree and as ``nn.Module``s for ``torch.func.functional_call``. ``Config.residual``
optionally pins the residual stream's sharding (sequence parallelism)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import P, constrain


@dataclass(frozen=True)
class Config:
    vocab: int = 32
    seq: int = 8
    d: int = 16
    heads: int = 4
    hidden: int = 32
    layers: int = 2
    eps: float = 1e-5
    residual: P | None = None  # e.g. P(None, "tp"): the residual stream split over the sequence


def init(cfg: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    params = {
        "embed.weight": w(cfg.vocab, cfg.d),
        "norm.weight": torch.ones(cfg.d),
        "head.weight": w(cfg.vocab, cfg.d),
    }
    for i in range(cfg.layers):
        p = f"layers.{i}."
        params.update(
            {
                p + "attn_norm.weight": torch.ones(cfg.d),
                p + "ffn_norm.weight": torch.ones(cfg.d),
                p + "attn.wq.weight": w(cfg.d, cfg.d),
                p + "attn.wk.weight": w(cfg.d, cfg.d),
                p + "attn.wv.weight": w(cfg.d, cfg.d),
                p + "attn.wo.weight": w(cfg.d, cfg.d),
                p + "ffn.w1.weight": w(cfg.hidden, cfg.d),
                p + "ffn.w3.weight": w(cfg.hidden, cfg.d),
                p + "ffn.w2.weight": w(cfg.d, cfg.hidden),
            }
        )
    return params


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of the head dim by position-dependent angles (x: b, h, s, hd)."""
    s, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)  # s, hd/2
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def attention(p: dict[str, torch.Tensor], pre: str, x: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, d = x.shape
    q, k, v = (
        F.linear(x, p[pre + n]).view(b, s, heads, d // heads).transpose(1, 2)
        for n in ("wq.weight", "wk.weight", "wv.weight")
    )
    y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
    return F.linear(y.transpose(1, 2).reshape(b, s, d), p[pre + "wo.weight"])


def forward(p: dict[str, torch.Tensor], tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    x = F.embedding(tokens, p["embed.weight"])
    for i in range(cfg.layers):
        pre = f"layers.{i}."
        x = pin(x, cfg)
        x = x + attention(p, pre + "attn.", rms_norm(x, p[pre + "attn_norm.weight"], cfg.eps), cfg.heads)
        h = rms_norm(x, p[pre + "ffn_norm.weight"], cfg.eps)
        gate = F.silu(F.linear(h, p[pre + "ffn.w1.weight"])) * F.linear(h, p[pre + "ffn.w3.weight"])
        x = x + F.linear(gate, p[pre + "ffn.w2.weight"])
    return F.linear(rms_norm(x, p["norm.weight"], cfg.eps), p["head.weight"])


def pin(x: torch.Tensor, cfg: Config) -> torch.Tensor:
    return constrain(x, cfg.residual) if cfg.residual is not None else x


def loss_fn(
    p: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor, cfg: Config
) -> torch.Tensor:
    logits = forward(p, tokens, cfg)
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1), ignore_index=-100)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.d, cfg.d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            m(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for m in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class Llama(nn.Module):
    """The same model as ``forward``: ``functional_call(Llama(cfg), params, (tokens,))``."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList()
        for _ in range(cfg.layers):
            layer = nn.Module()
            layer.attn_norm, layer.attn = RMSNorm(cfg.d, cfg.eps), Attention(cfg)
            layer.ffn_norm = RMSNorm(cfg.d, cfg.eps)
            layer.ffn = nn.ModuleDict(
                {
                    n: nn.Linear(a, b, bias=False)
                    for n, a, b in (
                        ("w1", cfg.d, cfg.hidden),
                        ("w3", cfg.d, cfg.hidden),
                        ("w2", cfg.hidden, cfg.d),
                    )
                }
            )
            self.layers.append(layer)
        self.norm = RMSNorm(cfg.d, cfg.eps)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        self.cfg = cfg

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = pin(x, self.cfg)
            x = x + layer.attn(layer.attn_norm(x))
            h = layer.ffn_norm(x)
            x = x + layer.ffn["w2"](F.silu(layer.ffn["w1"](h)) * layer.ffn["w3"](h))
        return self.head(self.norm(x))
