"""``value_and_grad``: loss and gradients in one traced step, with optional gradient accumulation."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.fx.traceback as fxt

from compiler.pipeline.boundary import cuts_from_zero
from shardspec.errors import fail

MICROBATCH = "shardspec_microbatch"  # key in a traced node's meta["custom"]: which microbatch made it
CALL = "shardspec_grad_call"  # ... and which value_and_grad call (a pipeline schedules exactly one)
_CALLS = itertools.count()


def value_and_grad(
    fn: Callable[..., torch.Tensor],
    argnums: int | Sequence[int] = 0,
    *,
    microbatches: int | None = None,
    batch_argnums: int | Sequence[int] | None = None,
) -> Callable[..., tuple[torch.Tensor, Any]]:
    """``(loss, grads)`` of a scalar ``fn`` with respect to argument(s) ``argnums``.

    With ``microbatches=m`` the batch arguments are split into ``m`` chunks along dim 0, chunk k
    holding rows k, k + m, k + 2m, ... (so a batch split over data-parallel devices splits every
    chunk the same way and no rows move), and the loss and gradients are the mean over chunks
    (gradient accumulation: the chunks' gradients add up as pending sums and are reduced once per
    step). The batch arguments are ``batch_argnums``; by default (``None``) every argument not
    differentiated, so an argument meant for every example (a mask, a table) must be left out by
    naming the batches: ``batch_argnums=(1, 2)``. Arguments outside it go whole to every chunk.
    Each chunk's forward and backward nodes are labelled with its index
    (``meta["custom"]["shardspec_microbatch"]``), which the pipeline schedules by; the
    accumulation is unlabelled (it runs after the chunks). Example::

        loss, grads = shardspec.value_and_grad(loss_fn)(params, x, y)  # grads: like params
        loss, grads = shardspec.value_and_grad(loss_fn, microbatches=4)(params, x, y)
        loss, grads = shardspec.value_and_grad(loss_fn, microbatches=4, batch_argnums=(1, 2))(
            params, x, y, mask
        )  # mask: the same for every chunk
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    batches = (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums
    if batches is not None and set(batches) & set(nums):
        raise fail(
            f"value_and_grad(argnums={argnums!r}, batch_argnums={batch_argnums!r}): argument(s) "
            f"{sorted(set(batches) & set(nums))} are both differentiated and split into microbatches.",
            "list in batch_argnums only the batch arguments (inputs, labels), not the parameters.",
        )
    name = getattr(fn, "__name__", "the function")

    def scalar(*args: Any) -> torch.Tensor:
        out = fn(*args)
        if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
            what = (
                f"a {type(out).__name__}"
                if not isinstance(out, torch.Tensor)
                else (f"a {out.dtype} tensor of shape {tuple(out.shape)}")
            )
            raise fail(
                f"value_and_grad({name}) needs a floating-point scalar loss, but {name} returned {what}.",
                "reduce the loss to one value (e.g. .mean() or .sum()) before returning it.",
            )
        return out

    grad_fn = torch.func.grad_and_value(scalar, argnums=argnums if isinstance(argnums, int) else nums)

    def run(*args: Any) -> tuple[torch.Tensor, Any]:
        call = next(_CALLS)
        _check_differentiable(nums, argnums, args)
        if microbatches is None or microbatches == 1:
            grads, loss = _labelled(grad_fn, 0, call, args)
            return loss, grads
        if not isinstance(microbatches, int) or microbatches < 1:
            raise fail(
                f"value_and_grad(microbatches={microbatches!r}) must be a positive int.",
                "pass the number of chunks to split the batch into.",
            )
        if batches is not None and (bad := [b for b in batches if not 0 <= b < len(args)]):
            raise fail(
                f"value_and_grad(batch_argnums={batch_argnums!r}) names argument(s) {bad}, but the "
                f"function was called with {len(args)} argument(s).",
                f"name positions 0 to {len(args) - 1} (the batch arguments).",
            )
        chunks = []
        for i, a in enumerate(args):
            if i in nums or (batches is not None and i not in batches):
                chunks.append([a] * microbatches)  # differentiated, or the same for every example
                continue
            chunks.append(_split(a, microbatches, i))
        total_loss, total_grads = None, None
        for k in range(microbatches):
            grads, loss = _labelled(grad_fn, k, call, tuple(c[k] for c in chunks))
            total_loss = loss if total_loss is None else total_loss + loss
            total_grads = grads if total_grads is None else optree.tree_map(torch.add, total_grads, grads)
        assert total_loss is not None and total_grads is not None
        return total_loss / microbatches, optree.tree_map(lambda g: g / microbatches, total_grads)

    return run


def _check_differentiable(nums: tuple[int, ...], argnums: Any, args: tuple[Any, ...]) -> None:
    """The differentiated arguments exist and hold floating-point tensors only."""
    if bad := [n for n in nums if not isinstance(n, int) or not -len(args) <= n < len(args)]:
        raise fail(
            f"value_and_grad(argnums={argnums!r}) names argument(s) {bad}, but the function was "
            f"called with {len(args)} argument(s).",
            f"name positions 0 to {len(args) - 1} (the arguments to differentiate, e.g. the parameters).",
        )
    for n in nums:
        paths, leaves, _ = optree.tree_flatten_with_path(args[n], none_is_leaf=False)
        for path, leaf in zip(paths, leaves, strict=True):
            if isinstance(leaf, torch.Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
                where = f"argument {n}" + "".join(f"[{p!r}]" for p in path)
                raise fail(
                    f"value_and_grad: {where} is a {leaf.dtype} tensor of shape {tuple(leaf.shape)}, "
                    "and only floating-point tensors have gradients.",
                    "differentiate only the float parameters: pass integer leaves (token ids, step "
                    "counters) in another argument, or cast them to a float dtype.",
                )


def _labelled(grad_fn: Callable[..., Any], k: int, call: int, args: tuple[Any, ...]) -> Any:
    """Run one chunk with its nodes labelled ``k`` (of call ``call``) and the pipeline cuts
    numbered from 0."""
    with cuts_from_zero(), fxt.annotate({MICROBATCH: k, CALL: call}):
        return grad_fn(*args)


def _split(arg: Any, m: int, position: int) -> list[Any]:
    leaves, tree = optree.tree_flatten(arg, none_is_leaf=False)
    per_leaf = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] % m:
                raise fail(
                    f"value_and_grad: argument {position} has a leaf of shape {tuple(leaf.shape)}"
                    f", whose dim 0 does not split into {m} microbatches.",
                    f"use a batch size divisible by {m}.",
                )
            # microbatch k = rows k, k + m, k + 2m, ...: a batch split over devices along dim 0
            # splits every microbatch the same way, so no rows move between devices
            rows = leaf.reshape(leaf.shape[0] // m, m, *leaf.shape[1:])
            per_leaf.append([rows[:, k] for k in range(m)])
        else:
            per_leaf.append([leaf] * m)
    return [optree.tree_unflatten(tree, [p[k] for p in per_leaf]) for k in range(m)]
