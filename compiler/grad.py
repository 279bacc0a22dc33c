"""``value_and_grad``: loss and gradients in one traced step, with optional gradient accumulation."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.fx.traceback as fxt

from compiler.pipeline.boundary import cuts_from_zero
from shardspec.errors import fail, shown

MICROBATCH = "shardspec_microbatch"  # key in a traced node's meta["custom"]: which microbatch made it
CALL = "shardspec_grad_call"  # ... and which value_and_grad call (a pipeline schedules exactly one)
_CALLS = itertools.count()


def value_and_grad(
    fn: Callable[..., torch.Tensor],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    microbatches: int | None = None,
    batch_argnums: int | Sequence[int] | None = None,
) -> Callable[..., tuple[Any, Any]]:
    """``(loss, grads)`` of a scalar ``fn`` with respect to argument(s) ``argnums``.

    With ``has_aux=True`` (as ``jax.value_and_grad``), ``fn`` returns ``(loss, aux)``, aux any
    pytree (metrics, new buffers) that is not differentiated, and the result is
    ``((loss, aux), grads)``. With microbatches each tensor of aux comes back stacked on a new
    leading dim, index k holding microbatch k's (reduce it as the metric needs: a mean, a sum).

    With ``microbatches=m`` the batch arguments are split into ``m`` chunks along dim 0, chunk k
    holding rows k, k + m, k + 2m, ... (so a batch split over data-parallel devices splits every
    chunk the same way and, when B / m divides over them, no rows move), and the loss and gradients
    are the mean over chunks (a loss coupling a batch's examples sees each chunk's rows only)
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
            f"value_and_grad(argnums={shown(argnums)}, batch_argnums={shown(batch_argnums)}): argument(s) "
            f"{sorted(set(batches) & set(nums))} are both differentiated and split into microbatches.",
            "list in batch_argnums only the batch arguments (inputs, labels), not the parameters.",
        )
    name = getattr(fn, "__name__", "the function")

    aux_trees: list[Any] = []

    trees: list[Any] = []  # the differentiated arguments' trees, while torch.func runs scalar

    def scalar(*args: Any, **kwargs: Any) -> Any:
        own = trees[-1]
        args = tuple(optree.tree_unflatten(own[n], list(a)) if n in own else a for n, a in enumerate(args))
        out = fn(*args, **kwargs)
        if has_aux:
            if not isinstance(out, tuple) or len(out) != 2:
                raise fail(
                    f"value_and_grad({name}, has_aux=True) needs {name} to return a pair (loss, aux), "
                    f"but it returned {_what(out)}.",
                    "return (loss, aux), or leave has_aux off and return the loss alone.",
                )
            _check_loss(name, out[0])
            _check_aux(name, out[1])
            leaves, tree = optree.tree_flatten(out[1], none_is_leaf=False)
            aux_trees.append(tree)  # torch.func takes tensors only: None leaves come back after
            return out[0], tuple(leaves)
        _check_loss(name, out)
        return out

    grad_fn = torch.func.grad_and_value(
        scalar, argnums=argnums if isinstance(argnums, int) else nums, has_aux=has_aux
    )

    def differentiate(k: int, call: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """grad_fn on ``args`` whose differentiated ones travel as tuples of their tensor leaves
        (torch.func's trees take None for a leaf, ours an empty subtree): grads come back in the
        arguments' own trees, a None where the argument has one."""
        pos = [n % len(args) for n in nums]
        flat = {n: optree.tree_flatten(args[n], none_is_leaf=False) for n in pos}
        trees.append({n: tree for n, (_, tree) in flat.items()})
        try:
            leaves = tuple(tuple(flat[n][0]) if n in flat else a for n, a in enumerate(args))
            grads, value = _labelled(grad_fn, k, call, leaves, kwargs)
        finally:
            trees.pop()
        if isinstance(argnums, int):
            return optree.tree_unflatten(flat[pos[0]][1], list(grads)), value
        return tuple(
            optree.tree_unflatten(flat[n][1], list(g)) for n, g in zip(pos, grads, strict=True)
        ), value

    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        call = next(_CALLS)
        _check_differentiable(nums, argnums, args)
        if batches is not None and (bad := [b for b in batches if not -len(args) <= b < len(args)]):
            raise fail(
                f"value_and_grad(batch_argnums={shown(batch_argnums)}) names argument(s) {bad}, but the "
                f"function was called with {len(args)} argument(s).",
                f"name positions 0 to {len(args) - 1} (or -1 to -{len(args)} from the end).",
            )
        if batches is not None and (both := {n % len(args) for n in nums} & {b % len(args) for b in batches}):
            raise fail(
                f"value_and_grad(argnums={shown(argnums)}, batch_argnums={shown(batch_argnums)}): "
                f"argument(s) {sorted(both)} are both differentiated and split into microbatches.",
                "list in batch_argnums only the batch arguments (inputs, labels), not the parameters.",
            )
        if microbatches is None or microbatches == 1:
            grads, value = differentiate(0, call, args, kwargs)
            return (_with_aux(value, aux_trees) if has_aux else value), grads
        if not isinstance(microbatches, int) or microbatches < 1:
            raise fail(
                f"value_and_grad(microbatches={shown(microbatches)}) must be a positive int.",
                "pass the number of chunks to split the batch into.",
            )
        split = None if batches is None else {b % len(args) for b in batches}  # as argnums: -1 last
        chunks = []
        for i, a in enumerate(args):
            if i in {n % len(args) for n in nums} or (split is not None and i not in split):
                chunks.append([a] * microbatches)  # differentiated, or the same for every example
                continue
            chunks.append(_split(a, microbatches, i))
        # keyword arguments are batches by default too (never differentiated); with batch_argnums,
        # which names positions, they go whole to every chunk
        kw_chunks = [dict(kwargs) for _ in range(microbatches)]
        if batches is None:
            for key, a in kwargs.items():
                for k, piece in enumerate(_split(a, microbatches, key)):
                    kw_chunks[k][key] = piece
        if all(c[0] is a for c, a in zip(chunks, args, strict=True)) and (batches is not None or not kwargs):
            raise fail(
                f"value_and_grad({name}, microbatches={microbatches}, argnums={shown(argnums)}): no "
                f"argument is left to split into microbatches: all {len(args)} are differentiated"
                + ("" if batches is None else f" or not in batch_argnums={shown(batch_argnums)}")
                + f", so {name} would run {microbatches} times on the whole batch.",
                "pass the batch (inputs, labels) as an argument that argnums does not name, or drop "
                "microbatches; to differentiate with respect to the inputs too, split the batch "
                "yourself and add up the gradients of value_and_grad over the pieces.",
            )
        total_loss, total_grads, auxes = None, None, []
        for k in range(microbatches):
            grads, value = differentiate(k, call, tuple(c[k] for c in chunks), kw_chunks[k])
            loss = value[0] if has_aux else value
            if has_aux:
                auxes.append(_with_aux(value, aux_trees)[1])
            total_loss = loss if total_loss is None else total_loss + loss
            total_grads = grads if total_grads is None else optree.tree_map(torch.add, total_grads, grads)
        assert total_loss is not None and total_grads is not None
        mean = total_loss / microbatches, optree.tree_map(lambda g: g / microbatches, total_grads)
        if not has_aux:
            return mean
        return (mean[0], _stack_aux(auxes)), mean[1]

    return run


def _what(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"a {out.dtype} tensor of shape {tuple(out.shape)}"
    if isinstance(out, tuple):
        return f"a tuple of {len(out)}"
    return f"a {type(out).__name__}"


def _check_loss(name: str, out: Any) -> None:
    if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
        raise fail(
            f"value_and_grad({name}) needs a floating-point scalar loss, but {name} returned {_what(out)}.",
            "reduce the loss to one value (e.g. .mean() or .sum()) before returning it.",
        )


def _check_aux(name: str, aux: Any) -> None:
    paths, leaves, _ = optree.tree_flatten_with_path(aux, none_is_leaf=False)
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            where = "aux" + "".join(f"[{p!r}]" for p in path)
            raise fail(
                f"value_and_grad({name}, has_aux=True): {where} is a {type(leaf).__name__}, and aux "
                "holds tensors only (as torch.func.grad's does).",
                "return tensors in aux (torch.as_tensor(x)), or compute that value outside value_and_grad.",
            )


def _with_aux(value: tuple[Any, tuple[torch.Tensor, ...]], trees: list[Any]) -> tuple[Any, Any]:
    """(loss, aux) with aux rebuilt from the tensors torch.func returned and its tree."""
    return value[0], optree.tree_unflatten(trees.pop(), list(value[1]))


def _stack_aux(auxes: list[Any]) -> Any:
    """The microbatches' aux trees, each tensor stacked on a new leading dim (index k: chunk k)."""
    return optree.tree_map(lambda *xs: torch.stack(xs), auxes[0], *auxes[1:], none_is_leaf=False)


def _check_differentiable(nums: tuple[int, ...], argnums: Any, args: tuple[Any, ...]) -> None:
    """The differentiated arguments exist and hold floating-point tensors only."""
    if bad := [n for n in nums if not isinstance(n, int) or not -len(args) <= n < len(args)]:
        raise fail(
            f"value_and_grad(argnums={shown(argnums)}) names argument(s) {bad}, but the function was "
            f"called with {len(args)} argument(s).",
            f"name positions 0 to {len(args) - 1} (the arguments to differentiate, e.g. the parameters).",
        )
    for n in nums:
        paths, leaves, _ = optree.tree_flatten_with_path(args[n], none_is_leaf=False)
        for path, leaf in zip(paths, leaves, strict=True):
            where = f"argument {n}" + "".join(f"[{p!r}]" for p in path)
            if not isinstance(leaf, torch.Tensor):
                raise fail(
                    f"value_and_grad: {where} is a {type(leaf).__name__}, and only tensors are "
                    "differentiated (None leaves are fine: their gradient is None).",
                    "pass that value in an argument that is not differentiated, or as a float "
                    "tensor (torch.tensor(x)) to get its gradient.",
                )
            if not (leaf.is_floating_point() or leaf.is_complex()):
                raise fail(
                    f"value_and_grad: {where} is a {leaf.dtype} tensor of shape {tuple(leaf.shape)}, "
                    "and only floating-point tensors have gradients.",
                    "differentiate only the float parameters: pass integer leaves (token ids, step "
                    "counters) in another argument, or cast them to a float dtype.",
                )


def _labelled(
    grad_fn: Callable[..., Any], k: int, call: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run one chunk with its nodes labelled ``k`` (of call ``call``) and the pipeline cuts
    numbered from 0."""
    with cuts_from_zero(), fxt.annotate({MICROBATCH: k, CALL: call}):
        return grad_fn(*args, **kwargs)


def _split(arg: Any, m: int, position: int | str) -> list[Any]:
    leaves, tree = optree.tree_flatten(arg, none_is_leaf=False)
    per_leaf = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] % m:
                raise fail(
                    f"value_and_grad: argument {position} has a leaf of shape {tuple(leaf.shape)}"
                    f", whose dim 0 does not split into {m} microbatches.",
                    f"use a batch size divisible by {m}; if argument {position} is not a batch (a table "
                    "or weights used by every example), name the batch arguments with "
                    "value_and_grad(..., batch_argnums=(...)) so it goes whole to every microbatch.",
                )
            # microbatch k = rows k, k + m, k + 2m, ...: a batch split over devices along dim 0
            # splits every microbatch the same way, so no rows move between devices
            rows = leaf.reshape(leaf.shape[0] // m, m, *leaf.shape[1:])
            per_leaf.append([rows[:, k] for k in range(m)])
        else:
            per_leaf.append([leaf] * m)
    return [optree.tree_unflatten(tree, [p[k] for p in per_leaf]) for k in range(m)]
