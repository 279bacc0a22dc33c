"""The argument contract of a sharded step, checked before anything runs.

Every call: arguments are keyed for the compile cache (Python floats by their bits, so ``-0.0`` and
``0.0`` differ and ``nan`` hits the cache), leaves that are neither tensors nor Python scalars are
named, and tensors tied to autograd or to ``torch.func`` transforms are refused (the program runs
outside autograd, so gradients taken outside the step would be silently zero).

Real meshes add cross-rank agreement, because a disagreement there is a hang or a silent wrong answer:
each call all-reduces a digest of the call signature (tree, shapes, dtypes, Python scalar values), so
a rank whose arguments changed alone, or whose ``lr`` differs, gets an error, and a rank that never
calls the step is reported after ``timeout`` seconds instead of hanging. On a program's first call the
values of plain-tensor arguments (which mean the full global value on every rank) are fingerprinted
and compared, which catches each rank passing its own slice of the batch (the DDP habit) and
differently initialised replicated parameters.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, cast

import optree
import torch

from compiler.trace import arg_names, path_str
from shardspec.agree import (
    CHECKPOINT_CALLS,
    check_group,
    digest,
    disagreeing,
    groups,
    other_calls,
    start_disagreeing,
)
from shardspec.errors import fail
from shardspec.local import fingerprint
from shardspec.mesh import Mesh

_STATIC = (int, float, bool, str, type(None))
SMALL = 16  # plain CPU tensors of at most this many elements are compared by value on every call


def _scalar_key(x: Any) -> Any:
    if isinstance(x, float):  # -0.0 == 0.0 and nan != nan: key floats by their bits
        return ("float", struct.pack("<d", x))
    return (type(x).__name__, x)


def signature(fn: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The compile-cache key of a call; names the first leaf that cannot be part of a step."""
    leaves, tree = optree.tree_flatten(cast(Any, args), none_is_leaf=False)
    sig = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):  # a DTensor keys as the global tensor it stands for
            sig.append(("Tensor", tuple(x.shape), x.dtype, x.device.type))
        elif isinstance(x, _STATIC):
            sig.append(_scalar_key(x))
        else:  # paths only here: building them costs more than the rest of the key
            path = optree.tree_paths(cast(Any, args), none_is_leaf=False)[i]
            where = path_str(arg_names(fn, len(args))[path[0]], path[1:])
            raise fail(
                f"{where}: a leaf of type {type(x).__name__} is neither a tensor nor a Python scalar "
                "(int, float, bool, str, None), so it cannot be an argument of a sharded step.",
                "convert it with torch.as_tensor(...), register its class as a pytree node "
                "(optree.register_pytree_node), or close over it instead of passing it.",
            )
    return (tree, tuple(sig), ambient())


def ambient() -> tuple[Any, ...]:
    """The global torch state a trace bakes into the program: the default dtype (of a
    ``torch.ones(n)`` in the step) and autocast's state (its casts are traced). A step compiled
    under one and called under another would silently keep the first's dtypes."""
    casts = tuple(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in _AUTOCAST)
    return (torch.get_default_dtype(), casts)


_AUTOCAST = ("cpu", "cuda")


def check_autograd(fn: Any, args: tuple[Any, ...]) -> None:
    """Refuse calls whose gradients would be silently dropped."""
    paths, leaves, _ = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    for path, x in zip(paths, leaves, strict=True):
        if not isinstance(x, torch.Tensor):
            continue
        where = path_str(arg_names(fn, len(args))[path[0]], path[1:])
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            raise fail(
                f"{where} reaches the sharded step inside a torch.func transform (grad, vjp, vmap, "
                "jacrev, ...). The compiled program runs outside those transforms, so they cannot "
                "see through it (gradients would be silently zero).",
                "take gradients inside the step with shardspec.value_and_grad(loss_fn)(params, ...), "
                "and return them.",
            )
        if x.requires_grad and torch.is_grad_enabled():
            raise fail(
                f"{where} requires grad (shape {tuple(x.shape)}), but a sharded step's results are not "
                "connected to autograd: gradients taken outside the step (loss.backward()) would be "
                "missing.",
                "take gradients inside the step with shardspec.value_and_grad and return them; pass "
                "parameters as plain tensors (p.detach()) or call the step under torch.no_grad().",
            )


def check_not_dtensor(fn: Any, args: tuple[Any, ...], mesh: Mesh) -> None:
    """A simulated mesh takes global tensors; a DTensor there belongs to another (real) mesh."""
    from torch.distributed.tensor import DTensor

    paths, leaves, _ = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    for path, x in zip(paths, leaves, strict=True):
        if isinstance(x, DTensor):
            where = path_str(arg_names(fn, len(args))[path[0]], path[1:])
            raise fail(
                f"{where} is a DTensor (global shape {tuple(x.shape)}, placements "
                f"{tuple(x.placements)}), but the step's mesh {mesh.describe()} is simulated: it takes "
                "and returns ordinary global tensors.",
                f"pass shardspec.to_global({where}) (the global value), or use a real Mesh "
                "(simulate=False) under torchrun.",
            )


def check_dtensor_mesh(x: Any, mesh: Mesh, path: str) -> None:
    """A DTensor must live on the step's own device grid, not just one with the same axis names."""
    theirs = x.device_mesh
    ours = mesh.device_mesh
    if theirs is ours:
        return
    same = (
        tuple(theirs.mesh_dim_names or ()) == tuple(ours.mesh_dim_names or ())
        and theirs.mesh.tolist() == ours.mesh.tolist()
        and theirs.device_type == ours.device_type
    )
    if not same:
        layout = theirs.mesh.tolist() == ours.mesh.tolist() and theirs.device_type == ours.device_type
        why = (
            f"names its axes {tuple(ours.mesh_dim_names or ())}: its placements would be read on "
            "axes they were not made for"
            if layout
            else f"lays ranks out as {ours.mesh.tolist()}: its blocks would be read as other ranks' blocks"
        )
        raise fail(
            f"{path} is a DTensor on DeviceMesh {theirs.mesh.tolist()} with dims "
            f"{theirs.mesh_dim_names}, but the step's mesh {mesh.describe()} {why}.",
            f"build it on the step's mesh (mesh.device_mesh), or pass shardspec.to_global({path}) (the "
            "global value on every rank; a pipelined step's results live on their stage's ranks only).",
        )


def check_same_call(key: tuple[Any, ...], identity: str, program: int, name: str, timeout: float) -> None:
    """Every rank must call the same step with the same signature and hold the same program, else
    the collectives would not match (a hang) or pair up with another step's (a wrong answer)."""
    start_same_call(key, identity, program, name, timeout)()


def small_positions(tensors: list[Any], plain: tuple[bool, ...]) -> tuple[int, ...]:
    """The plain CPU tensors of at most ``SMALL`` elements: values such as a learning rate passed
    as a 0-dim tensor, compared across ranks on every call (a GPU tensor would need a sync)."""
    return tuple(
        i
        for i, (p, t) in enumerate(zip(plain, tensors, strict=True))
        if p and t.numel() <= SMALL and t.device.type == "cpu"
    )


def small_values(tensors: list[Any], positions: tuple[int, ...]) -> int:
    """A digest of the values at ``positions`` (0 when there are none)."""
    if not positions:
        return 0
    return digest(repr([tensors[i].reshape(-1).tolist() for i in positions]))


_KEY_DIGESTS: dict[tuple[Any, ...], int] = {}


def _key_digest(key: tuple[Any, ...]) -> int:
    """``digest(repr(key))``, remembered: a training step calls with one key every step, and the
    repr of a GPT step's key (hundreds of leaves and placements) costs more than its hash."""
    found = _KEY_DIGESTS.get(key)
    if found is None:
        if len(_KEY_DIGESTS) >= 256:
            _KEY_DIGESTS.clear()
        found = _KEY_DIGESTS[key] = digest(repr(key))
    return found


FAILED = -1  # the program number a rank whose compile raised sends in the agreement exchange


def start_same_call(
    key: tuple[Any, ...],
    identity: str,
    program: int,
    name: str,
    timeout: float,
    values: int = 0,
    describe: Callable[[], list[tuple[str, str]]] | None = None,
) -> Callable[[], None]:
    """``check_same_call`` issued now and completed by the returned function: the runtime completes
    it before the step's first collective, so the check's round trip overlaps the compute before it
    (the forward, for data parallelism) instead of adding to every call. ``values``: a digest of
    values that change between calls (``small_values``), kept out of the remembered key digest.
    ``describe``: the call's arguments as (path, description) pairs, exchanged only when the ranks'
    arguments differ, to name which."""
    mine = torch.tensor([digest(identity), _key_digest(key) ^ values, program], dtype=torch.int64)
    pending = start_disagreeing(mine, timeout, f"the rank-agreement check at the start of {name}(...)")

    def finish() -> None:
        everyone = pending()
        if everyone:
            _differing_calls(everyone, name, describe)

    return finish


def describe_call(fn: Any, args: tuple[Any, ...], ambient: tuple[Any, ...]) -> list[tuple[str, str]]:
    """(path, what the rank passed there) per argument leaf, plus what else keys the call
    (``ambient``: default dtype, autocast, the modules' train/eval flags)."""
    from torch.distributed.tensor import DTensor

    names = arg_names(fn, len(args))
    out = []
    paths, leaves, _ = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
    for path, leaf in zip(paths, leaves, strict=True):
        where = path_str(names[path[0]], path[1:])
        if isinstance(leaf, DTensor):
            text = f"a DTensor {tuple(leaf.shape)} {leaf.dtype} placed {tuple(leaf.placements)}"
        elif isinstance(leaf, torch.Tensor):
            text = f"a tensor {tuple(leaf.shape)} {leaf.dtype}"
            if leaf.numel() <= SMALL and leaf.device.type == "cpu":
                text += f" holding {leaf.reshape(-1).tolist()}"
        else:
            text = repr(leaf)
        out.append((where, text))
    out.append(("(the default dtype, autocast and the nn.Modules' train/eval flags)", repr(ambient)))
    return out


def _named_differences(describe: Callable[[], list[tuple[str, str]]] | None) -> str:
    """Which arguments differ between ranks, each with what the rank groups passed (every rank
    reaches this together, after the agreement check found their calls differ)."""
    import torch.distributed as dist

    if describe is None:
        return ""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(describe()), group=check_group())
    paths = list(dict.fromkeys(p for d in everyone for p in d))
    lines = []
    for p in paths:
        seen = [d.get(p, "nothing") for d in everyone]
        if len(set(seen)) > 1:
            ranks: dict[str, list[int]] = {}
            for r, text in enumerate(seen):
                ranks.setdefault(text, []).append(r)
            lines.append(f"{p}: " + "; ".join(f"ranks {rs} {text}" for text, rs in ranks.items()))
    shown = lines[:3] + ([f"and {len(lines) - 3} more"] if len(lines) > 3 else [])
    return (" Differing: " + " | ".join(shown) + ".") if shown else ""


def _differing_calls(
    everyone: list[torch.Tensor], name: str, describe: Callable[[], list[tuple[str, str]]] | None = None
) -> None:
    other_calls(everyone, f"{name}(...)", lambda word: word not in CHECKPOINT_CALLS)
    failed = [r for r, v in enumerate(everyone) if int(v[2]) == FAILED]
    if failed:
        raise fail(
            f"rank(s) {failed} could not compile {name}(...): their own error says why (a spec, "
            "argument or Python error only those ranks hit); this rank's call was not run.",
            "fix the error reported on those ranks; if it depends on the rank (rank-local data or "
            "a rank-dependent branch in the step), make every rank call the step alike.",
        )
    which = next(i for i in range(3) if len({int(v[i]) for v in everyone}) > 1)
    ranks = groups([v[which : which + 1] for v in everyone])
    what = (
        f"ranks called different sharded steps at the same point ({name}(...) on some): rank groups {ranks}",
        f"ranks called {name}(...) with different arguments (tree structure, shapes, dtypes, Python "
        f"scalar values, the values of small CPU tensors such as a 0-dim learning rate, which are "
        f"DTensors and their placements, or the train/eval mode of the nn.Modules the step reaches "
        f"differ): rank groups {ranks}",
        f"ranks compiled different programs for {name}(...) (specs, collective sequences, or Python "
        f"values baked into the step, such as a learning rate a closure captured, differ): rank groups "
        f"{ranks}",
    )[which]
    named = _named_differences(describe) if which == 1 else ""
    raise fail(
        f"{what}.{named} Running would hang or compute wrong results.",
        "call the same steps in the same order on every rank, with the same shapes and Python values "
        "(e.g. lr), and no rank-dependent branches inside the step; rank-local data goes in through "
        "shardspec.from_local. With AUTO specs or cost_model=, a rank whose planner solve hit its time "
        "limit (a loaded machine) may plan differently: write the specs explain() reports instead.",
    )


def check_same_values(tensors: list[Any], paths: tuple[str, ...], name: str, timeout: float) -> None:
    """Plain tensors mean the full global value on every rank: compare fingerprints across ranks."""
    from torch.distributed.tensor import DTensor

    plain = [(p, t) for p, t in zip(paths, tensors, strict=True) if not isinstance(t, DTensor)]
    if not plain:
        return
    values = torch.tensor([v for _, t in plain for v in fingerprint(t)], dtype=torch.int64)
    everyone = disagreeing(values, timeout, f"the argument-value check of {name}(...)")
    if not everyone:
        return
    differ = [
        p
        for i, (p, _) in enumerate(plain)
        if len({tuple(v[2 * i : 2 * i + 2].tolist()) for v in everyone}) > 1
    ]
    raise fail(
        f"plain-tensor arguments of {name}(...) hold different values on different ranks: "
        f"{', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''} (rank groups {groups(everyone)}). "
        "On a real mesh a plain tensor means the full global value, the same on every rank; each rank "
        "passing its own slice of the batch (the DDP habit) or initialising replicated parameters with its "
        "own seed would train on wrong data.",
        "pass identical full tensors on every rank (seed the initialisation the same), or build "
        "DTensors from each rank's own block with shardspec.from_local(tree, specs, mesh). "
        "sharded(..., check_values=False) skips this check.",
    )
