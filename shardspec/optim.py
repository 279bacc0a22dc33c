"""Functional optimizers, optax-style: ``init(params) -> state``, ``update(grads, state, params) ->
(params, state)``, ``state_specs(param_specs) -> state specs``.

The state mirrors the parameter tree, so sharding the state (ZeRO-1/2) or the parameters too (ZeRO-3)
is a spec, not a different optimizer. Updates follow ``torch.optim.SGD`` / ``torch.optim.AdamW``
exactly (decoupled weight decay, bias correction), so a step compares against torch's optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from shardspec.errors import fail
from shardspec.spec import P


def _map(fn: Any, *trees: Any) -> Any:
    return optree.tree_map(fn, *trees, none_is_leaf=False)


@dataclass(frozen=True)
class SGD:
    lr: float
    momentum: float = 0.0

    def init(self, params: Any) -> dict[str, Any]:
        return {"momentum": _map(torch.zeros_like, params)} if self.momentum else {}

    def state_specs(self, param_specs: Any) -> dict[str, Any]:
        return {"momentum": param_specs} if self.momentum else {}

    def update(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        if self.momentum:
            buf = _map(lambda b, g: self.momentum * b + g, state["momentum"], grads)
            return _map(lambda p, b: p - self.lr * b, params, buf), {"momentum": buf}
        return _map(lambda p, g: p - self.lr * g, params, grads), {}


@dataclass(frozen=True)
class AdamW:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def init(self, params: Any) -> dict[str, Any]:
        return {
            "step": torch.zeros(()),
            "m": _map(torch.zeros_like, params),
            "v": _map(torch.zeros_like, params),
        }

    def state_specs(self, param_specs: Any) -> dict[str, Any]:
        return {"step": P(), "m": param_specs, "v": param_specs}

    def update(self, grads: Any, state: dict[str, Any], params: Any) -> tuple[Any, dict[str, Any]]:
        b1, b2 = self.betas
        step = state["step"] + 1
        m = _map(lambda m_, g: b1 * m_ + (1 - b1) * g, state["m"], grads)
        v = _map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, state["v"], grads)
        bias1 = 1 - torch.pow(b1, step)
        bias2_sqrt = torch.sqrt(1 - torch.pow(b2, step))

        def apply(p: torch.Tensor, m_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            decayed = p * (1 - self.lr * self.weight_decay) if self.weight_decay else p
            denom = torch.sqrt(v_) / bias2_sqrt + self.eps
            return decayed - (self.lr / bias1) * m_ / denom

        return _map(apply, params, m, v), {"step": step, "m": m, "v": v}


def sgd(lr: float, momentum: float = 0.0) -> SGD:
    """Stochastic gradient descent, with optional (heavy-ball) momentum."""
    if lr <= 0 or momentum < 0:
        raise fail(
            f"sgd(lr={lr}, momentum={momentum}): lr must be > 0 and momentum >= 0.",
            "pass e.g. sgd(lr=0.1, momentum=0.9).",
        )
    return SGD(lr, momentum)


def adamw(
    lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
) -> AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW."""
    if lr <= 0 or not all(0 <= b < 1 for b in betas) or eps <= 0 or weight_decay < 0:
        raise fail(
            f"adamw(lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}): out of range.",
            "use lr > 0, 0 <= betas < 1, eps > 0, weight_decay >= 0.",
        )
    return AdamW(lr, betas, eps, weight_decay)
