"""A small GPT-2-style decoder, written twice over the same parameter tree: as pure functions, and as
``torch.nn.Module``s for ``torch.func.functional_call``. Both compute the same loss.

The fused qkv projection is head-major (rows laid out as heads x (q, k, v) x head_dim, as Megatron
does), so splitting its rows over a tensor-parallel axis splits heads and q, k, v stay local.
``Config.residual`` optionally pins the residual stream's sharding (sequence parallelism).
"""

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
    layers: int = 2
    residual: P | None = None  # e.g. P(None, "tp"): the residual stream split over the sequence


def init(cfg: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    params = {
        "wte": w(cfg.vocab, cfg.d),
        "wpe": w(cfg.seq, cfg.d),
        "ln_f.weight": torch.ones(cfg.d),
        "ln_f.bias": torch.zeros(cfg.d),
        "head.weight": w(cfg.vocab, cfg.d),
    }
    for i in range(cfg.layers):
        p = f"h.{i}."
        params.update(
            {
                p + "ln1.weight": torch.ones(cfg.d),
                p + "ln1.bias": torch.zeros(cfg.d),
                p + "attn.qkv.weight": w(3 * cfg.d, cfg.d),
                p + "attn.qkv.bias": torch.zeros(3 * cfg.d),
                p + "attn.proj.weight": w(cfg.d, cfg.d),
                p + "attn.proj.bias": torch.zeros(cfg.d),
                p + "ln2.weight": torch.ones(cfg.d),
                p + "ln2.bias": torch.zeros(cfg.d),
                p + "mlp.fc.weight": w(4 * cfg.d, cfg.d),
                p + "mlp.fc.bias": torch.zeros(4 * cfg.d),
                p + "mlp.proj.weight": w(cfg.d, 4 * cfg.d),
                p + "mlp.proj.bias": torch.zeros(cfg.d),
            }
        )
    return params


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """(b, s, heads * 3 * hd) -> q, k, v of shape (b, heads, s, hd)."""
    b, s, width = qkv.shape
    q, k, v = qkv.view(b, s, heads, 3, width // (3 * heads)).unbind(3)
    return tuple(t.transpose(1, 2) for t in (q, k, v))


def attention(p: dict[str, torch.Tensor], pre: str, x: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, d = x.shape
    q, k, v = split_heads(F.linear(x, p[pre + "qkv.weight"], p[pre + "qkv.bias"]), heads)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(b, s, d)
    return F.linear(y, p[pre + "proj.weight"], p[pre + "proj.bias"])


def block(
    p: dict[str, torch.Tensor], pre: str, x: torch.Tensor, heads: int, residual: P | None = None
) -> torch.Tensor:
    """One transformer block; ``residual``: the layout to pin the residual stream to after each
    sum (sequence parallelism: split over the sequence, so the row-parallel outputs are
    reduce-scattered into it and gathered again for the next layer norm's matmul)."""
    d = x.shape[-1]
    x = x + attention(
        p, pre + "attn.", F.layer_norm(x, (d,), p[pre + "ln1.weight"], p[pre + "ln1.bias"]), heads
    )
    if residual is not None:
        x = constrain(x, residual)
    h = F.layer_norm(x, (d,), p[pre + "ln2.weight"], p[pre + "ln2.bias"])
    h = F.gelu(F.linear(h, p[pre + "mlp.fc.weight"], p[pre + "mlp.fc.bias"]), approximate="tanh")
    return x + F.linear(h, p[pre + "mlp.proj.weight"], p[pre + "mlp.proj.bias"])


def forward(p: dict[str, torch.Tensor], tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    s = tokens.shape[1]
    x = F.embedding(tokens, p["wte"]) + p["wpe"][:s]
    for i in range(cfg.layers):
        x = pin(block(p, f"h.{i}.", pin(x, cfg), cfg.heads, cfg.residual), cfg)
    x = F.layer_norm(x, (cfg.d,), p["ln_f.weight"], p["ln_f.bias"])
    return F.linear(x, p["head.weight"])


def pin(x: torch.Tensor, cfg: Config) -> torch.Tensor:
    return constrain(x, cfg.residual) if cfg.residual is not None else x


def loss_fn(
    p: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor, cfg: Config
) -> torch.Tensor:
    logits = forward(p, tokens, cfg)
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1), ignore_index=-100)


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = split_heads(self.qkv(x), self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(cfg.d), Attention(cfg), nn.LayerNorm(cfg.d)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(cfg.d, 4 * cfg.d), "proj": nn.Linear(4 * cfg.d, cfg.d)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = F.gelu(self.mlp["fc"](self.ln2(x)), approximate="tanh")
        return x + self.mlp["proj"](h)


class GPT(nn.Module):
    """The same model as ``forward``: ``functional_call(GPT(cfg), params, (tokens,))``."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.wte = nn.Parameter(torch.zeros(cfg.vocab, cfg.d))
        self.wpe = nn.Parameter(torch.zeros(cfg.seq, cfg.d))
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        self.cfg = cfg

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.wte) + self.wpe[: tokens.shape[1]]
        for blk in self.h:
            x = pin(blk(pin(x, self.cfg)), self.cfg)
        return self.head(self.ln_f(x))
