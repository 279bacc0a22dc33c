"""Spec configurations for the GPT and Llama training tests (mesh dp x tp)."""

from __future__ import annotations

from typing import Any

from shardspec import P

COLUMN = ("qkv.weight", "wq.weight", "wk.weight", "wv.weight", "fc.weight", "w1.weight", "w3.weight")
COLUMN_BIAS = ("qkv.bias", "fc.bias")
ROW = ("attn.proj.weight", "wo.weight", "mlp.proj.weight", "w2.weight")
ATTENTION = ("qkv.", "wq.", "wk.", "wv.", "attn.proj.", "wo.")


def megatron(params: dict[str, Any], only: tuple[str, ...] = ()) -> dict[str, P]:
    """Column-parallel in-projections (split output rows), row-parallel out-projections."""
    specs: dict[str, P] = {}
    for name in params:
        if only and not any(k in name for k in only):
            specs[name] = P()
        elif name.endswith(COLUMN):
            specs[name] = P("tp", None)
        elif name.endswith(COLUMN_BIAS):
            specs[name] = P("tp")
        elif name.endswith(ROW):
            specs[name] = P(None, "tp")
        else:
            specs[name] = P()
    return specs


def configurations(params: dict[str, Any]) -> dict[str, tuple[dict[str, P], P, P | None]]:
    """name -> (param specs, batch spec, residual-stream constraint)."""
    rep = {k: P() for k in params}
    return {
        "dp": (rep, P("dp"), None),
        "tp_megatron": (megatron(params), P(), None),
        "sequence_parallel": (megatron(params), P(), P(None, "tp")),
        "zero3": ({k: P("dp") for k in params}, P("dp"), None),
        "dp_x_tp": (megatron(params), P("dp"), None),
        "heads_split": (megatron(params, only=ATTENTION), P("dp"), None),
    }
