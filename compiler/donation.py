"""Donation bookkeeping at call time (``sharded(donate=...)``): which arguments a step may write
in place, that no other argument shares a donated buffer, and that a tensor given up by an earlier
call is not passed again (its storage may now hold that call's results)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import optree
import torch

from compiler.backend import dtensor_type
from compiler.program import Program
from compiler.trace import arg_names
from shardspec.errors import fail, shown

# Tensors given up by an earlier call (donate=): id -> (weak reference, argument path, step name)
DONATED: dict[int, tuple[weakref.ref[Any], str, str]] = {}


def donate_argnums(donate: Any) -> tuple[int, ...]:
    if isinstance(donate, int) and not isinstance(donate, bool):
        donate = (donate,)
    ok = isinstance(donate, (tuple, list)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in donate
    )
    if not ok:
        raise fail(
            f"sharded(donate={shown(donate)}) is not a tuple of argument positions.",
            "pass the positions of the arguments whose buffers the step may reuse, e.g. donate=(0, 1).",
        )
    return tuple(sorted(set(donate)))


def mark_donated(t: Any, path: str, step: str) -> None:
    key = id(t)
    DONATED[key] = (weakref.ref(t, lambda _: DONATED.pop(key, None)), path, step)


def suspect(leaves: list[Any]) -> bool:
    """Whether a leaf might fail ``inputs.check_autograd`` or ``check_not_donated`` (both walk
    the tree with paths and format each leaf's name: about 2 ms per call of a GPT step)."""
    grad = torch.is_grad_enabled()
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return any(
        isinstance(t, torch.Tensor) and ((grad and t.requires_grad) or wrapped(t) or id(t) in DONATED)
        for t in leaves
    )


def check_donated_alone(tensors: list[Any], program: Program) -> None:
    """A donated buffer is written in place: no other argument may overlap its memory (a tensor
    passed twice, tied weights, m and v as one tensor), or one update would overwrite another's
    input. Views of one buffer whose byte spans do not overlap (a flat buffer sliced into parameters)
    are fine; interleaved views (``buf[:, 0::2]`` and ``buf[:, 1::2]``) span each other and are
    refused. One sort of the arguments' byte spans, so the check costs little per call."""
    spans = []
    dtensor = dtensor_type()
    for i, t in enumerate(tensors):
        local = t._local_tensor if isinstance(t, dtensor) else t
        start = local.data_ptr()
        if local.is_contiguous():
            if local.nbytes:
                spans.append((start, start + local.nbytes, i))
        elif local.numel():
            extent = 1 + sum((n - 1) * s for n, s in zip(local.shape, local.stride(), strict=True))
            spans.append((start, start + extent * local.element_size(), i))
    spans.sort()
    donated = set(program.donated)
    reach, last = -1, -1
    for start, end, i in spans:
        if start < reach and (i in donated or last in donated):
            a, b = sorted((i, last))
            paths = program.traced.in_paths
            raise fail(
                f"{paths[b]} shares memory with {paths[a]}, and one of them is donated "
                "(sharded(donate=...)): the step writes donated buffers in place, so one update "
                "would overwrite the other's input.",
                f"pass distinct tensors (e.g. {paths[b]}.clone()), or do not donate that argument.",
            )
        if end > reach:
            reach, last = end, i


def check_not_donated(args: tuple[Any, ...], fn: Callable[..., Any]) -> None:
    """A donated tensor's storage now holds another call's results: using it again is an error."""
    if not DONATED:
        return
    names = arg_names(fn, len(args))
    paths, leaves, _ = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    for path, leaf in zip(paths, leaves, strict=True):
        entry = DONATED.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
        if entry is not None and entry[0]() is leaf:
            where = names[path[0]] + "".join(f"[{k!r}]" for k in path[1:])
            raise fail(
                f"{where} was donated to {entry[2]} (as {entry[1]}, sharded(donate=...)) by an earlier "
                "call; its buffer may now hold that call's results.",
                "pass the value that call returned instead (params, state = step(params, state, ...)).",
            )
