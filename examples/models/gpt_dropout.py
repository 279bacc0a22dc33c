"""The example GPT (``examples/models/gpt.py``, same parameters) with dropout on the embeddings,
attention output and MLP output, as GPT-2 trains. Under ``@sharded`` the dropout masks are
counter-based (``shardspec.random``): the same elements are dropped whatever the mesh and specs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardspec
from examples.models import gpt


def forward(p: dict[str, torch.Tensor], tokens: torch.Tensor, cfg: gpt.Config, rate: float) -> torch.Tensor:
    s, d = tokens.shape[1], cfg.d
    x = F.dropout(F.embedding(tokens, p["wte"]) + p["wpe"][:s], rate)
    for i in range(cfg.layers):
        pre = f"h.{i}."
        h = F.layer_norm(x, (d,), p[pre + "ln1.weight"], p[pre + "ln1.bias"])
        x = x + F.dropout(gpt.attention(p, pre + "attn.", h, cfg.heads), rate)
        h = F.layer_norm(x, (d,), p[pre + "ln2.weight"], p[pre + "ln2.bias"])
        h = F.gelu(F.linear(h, p[pre + "mlp.fc.weight"], p[pre + "mlp.fc.bias"]), approximate="tanh")
        x = x + F.dropout(F.linear(h, p[pre + "mlp.proj.weight"], p[pre + "mlp.proj.bias"]), rate)
    x = F.layer_norm(x, (d,), p["ln_f.weight"], p["ln_f.bias"])
    return F.linear(x, p["head.weight"])


def loss_fn(
    p: dict[str, torch.Tensor],
    tokens: torch.Tensor,
    targets: torch.Tensor,
    key: torch.Tensor,
    cfg: gpt.Config,
    rate: float = 0.1,
) -> torch.Tensor:
    """Mean next-token cross entropy, with dropout masks drawn from ``key``."""
    with shardspec.random.rng(key):
        logits = forward(p, tokens, cfg, rate)
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
