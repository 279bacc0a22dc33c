"""Tensors a step closes over are constants of its compiled program: their values are read when it
is traced. A later in-place change (``w.mul_(2)`` on a global or a method's ``self.w``) would not
be seen, nor a method's ``self.w = ...``, so every call checks the constants' version counters
(and, for a method, that ``self``'s attributes still hold them) and refuses one that changed."""

from __future__ import annotations

from typing import Any

import torch

from shardspec.errors import fail

Snapshot = tuple[tuple[tuple[str, torch.Tensor, int], ...], tuple[tuple[str, torch.Tensor], ...]]


def snapshot(constants: list[tuple[str, torch.Tensor]], owner: Any = None) -> Snapshot:
    """Each constant with its version counter now (inference tensors keep none: skipped), and the
    attributes of ``owner`` (a method's ``self``) that hold one."""
    out = []
    for what, t in constants:
        try:
            out.append((what, t, t._version))
        except RuntimeError:
            continue
    held = {id(t) for _, t in constants}
    attrs = getattr(owner, "__dict__", {})
    bound = tuple((k, v) for k, v in attrs.items() if isinstance(v, torch.Tensor) and id(v) in held)
    return tuple(out), bound


def check_unchanged(snap: Snapshot, name: Any, owner: Any = None) -> None:
    for attr, t in snap[1]:
        if getattr(owner, attr, None) is not t:
            raise fail(
                f"self.{attr} was set to another tensor after {name} compiled: the compiled program "
                f"holds the tensor self.{attr} held then (a constant), so this call would use it.",
                f"pass the tensors that change (parameters being trained) to {name} as arguments; "
                "a method's self holds what stays fixed.",
            )
    for what, t, version in snap[0]:
        if t._version != version:
            raise fail(
                f"{what}, of shape {tuple(t.shape)}, was modified in place after {name} compiled: the "
                "compiled program holds its value from then, so this call would use the old one.",
                f"pass that tensor to {name} as an argument (a tensor that changes between calls is "
                "an input, not a constant).",
            )
