"""Activation checkpointing: ``shardspec.remat(fn)`` recomputes ``fn``'s activations in backward.

A sharded step holds every activation backward reads from forward to backward: a model's depth
times a layer's activations. Wrapping a layer in ``remat`` marks the ops it traces as one region
(``torch.fx.traceback.annotate``, which the tracer copies onto each node it records); after
partition, the ``remat`` pass (``compiler/passes/remat.py``) copies the region's forward ops,
collectives inside it included (a ZeRO-3 parameter gather is issued again, and counted), to just
before the first backward op that reads one of its values. Only the region's inputs (and what the
policy saves) then live from forward to backward, as with ``jax.checkpoint`` and
``torch.utils.checkpoint``. The step computes the same values: recomputation runs the same ops on
the same inputs (random draws inside a step are counter-based: a recomputed dropout draws the
same mask).

Policies (which region values are kept instead of recomputed):
  - ``None``: nothing; every value backward reads is recomputed from the region's inputs.
  - ``"save_matmuls"``: matmul results (``mm``, ``bmm``, batched ``matmul``) are kept, the cheap
    elementwise ops around them recomputed (JAX's ``dots_saveable``).
  - a callable ``policy(op) -> bool`` given each traced ATen op (an ``OpOverload``): True keeps it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback as fxt
from torch.overrides import TorchFunctionMode

from compiler.sources import source_of, user_frame
from shardspec.errors import fail, shown

REGION = "shardspec_remat"  # node meta["custom"]: the region id
POLICY = "shardspec_remat_policy"
MATMULS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.shardspec.matmul.default,
    }
)
_VIEWS = frozenset(
    {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}
)
_POLICIES: dict[str, Callable[[Any], bool]] = {"save_matmuls": MATMULS.__contains__}
_IDS = itertools.count(1)

Policy = str | Callable[[Any], bool] | None


def remat(fn: Callable[..., Any] | None = None, *, policy: Policy = None) -> Any:
    """``fn`` whose activations are recomputed in backward instead of kept (see the module doc).

    Use as ``remat(layer)(x, params)``, ``@remat`` or ``@remat(policy="save_matmuls")``. Outside
    a sharded step it is ``fn`` itself.
    """
    if policy is not None and not callable(policy) and policy not in _POLICIES:
        raise fail(
            f"remat(policy={shown(policy)}) is not a policy.",
            f"use None (recompute everything), one of {sorted(_POLICIES)}, or a callable "
            "policy(op) -> bool that returns True for the ATen ops whose results are kept.",
        )
    if fn is None:
        return functools.partial(remat, policy=policy)
    if not callable(fn):
        raise fail(
            f"remat() wraps a function, got a {type(fn).__name__}.",
            "pass the layer function: remat(layer)(x, params).",
        )
    name = getattr(fn, "__name__", "fn")

    @functools.wraps(fn)
    def region(*args: Any, **kwargs: Any) -> Any:
        with fxt.annotate({REGION: next(_IDS), POLICY: policy}), _Pure(name):
            return fn(*args, **kwargs)

    return region


def regions(module: torch.fx.GraphModule) -> dict[str, tuple[int, bool]]:
    """Traced node name -> (region id, kept by the policy) for each forward op inside a ``remat``."""
    out: dict[str, tuple[int, bool]] = {}
    products: set[str] = set()  # kept matmuls and views of them
    for n in module.graph.nodes:
        custom = n.meta.get("custom") or {}
        if n.op != "call_function" or REGION not in custom or source_of(n).startswith("backward of "):
            continue
        policy = custom.get(POLICY)
        keep = _POLICIES.get(policy, policy) if isinstance(policy, str) else policy
        saved = bool(keep(n.target)) if callable(keep) else False
        # a bias added to a kept matmul (a linear layer's product viewed back to (..., out)
        # first) is kept with it: the per-rank program fuses the two (addmm, named after the add),
        # and keeping the matmul alone would then keep nothing
        if n.target is torch.ops.aten.add.Tensor or n.target in _VIEWS:
            saved = saved or any(a.name in products for a in n.all_input_nodes)
        if saved and (n.target in MATMULS or n.target in _VIEWS):
            products.add(n.name)
        out[n.name] = (int(custom[REGION]), saved)
    return out


_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}
_NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_"}


class _Pure(TorchFunctionMode):
    """Refuses an in-place write, inside a remat region, to a tensor the region did not create:
    recomputation would apply it twice, or read the written value where forward read the old."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.made: set[int] = set()
        self.keep: list[torch.Tensor] = []  # ids stay valid while the region runs

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        fname = getattr(func, "__name__", "")
        writes = fname in _INPLACE_DUNDERS or (
            fname.endswith("_") and not fname.endswith("__") and fname not in _NOT_WRITES
        )
        kwargs = kwargs or {}
        target = kwargs.get("out", args[0] if args else None)
        if writes and isinstance(target, torch.Tensor) and id(target) not in self.made:
            raise fail(
                f"remat({self.name}) writes in place to a tensor it did not create ({fname} on a "
                f"tensor of shape {tuple(target.shape)} at {user_frame()}); a rematerialized "
                "function is run again in backward, so its side effects would happen twice.",
                f"make {self.name} pure: compute a new tensor (`y = x + 1` instead of `x.add_(1)`) "
                "and return it, or move the write outside the remat region.",
            )
        out = func(*args, **kwargs)
        outside = [a for a in args if isinstance(a, torch.Tensor) and id(a) not in self.made]
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not any(_alias(t, a) for a in outside):
                self.made.add(id(t))  # new storage (a view of an outside tensor stays outside)
                self.keep.append(t)
        return out


def _alias(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is a view of ``b`` (by its view base: storages are hidden under transforms)."""
    base = a._base if a._is_view() else None
    return base is not None and (base is b or (b._is_view() and base is b._base))


__all__ = ["MATMULS", "Policy", "regions", "remat"]
