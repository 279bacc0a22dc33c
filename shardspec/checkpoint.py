"""Checkpoints of pytrees of (D)Tensors on top of ``torch.distributed.checkpoint`` (DCP).

DCP writes every rank's shards and reshards on load; this module adds what a training loop needs
around it: atomic publication (a crash mid-save never costs the previous checkpoint), a step number,
RNG state, a record of the tree so a mismatched ``like`` fails with the paths that differ, and layouts
named by ``P`` on a ``Mesh`` instead of DTensor placements.

Layout of a checkpoint root ``DIR``::

    DIR/step-00000040/   a complete checkpoint: DCP files, shardspec.json, rng-<rank>.pt
    DIR/latest           the name of the newest published checkpoint (replaced atomically)
    DIR/.tmp-step-N/     a save in progress, or one that crashed (never loaded)
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import optree
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from shardspec.agree import digest, disagreeing, groups, other_calls
from shardspec.checkpoint_files import (
    FORMAT,
    META,
    PREFIX,
    TMP,
    checksums,
    dcp_errors,
    gathered,
    owned_files,
    publish,
    read_meta,
    recover,
    resolve,
    save_lock,
    verify_files,
    write_atomic,
)
from shardspec.errors import ShardingError, fail, shown
from shardspec.layout import check_spec, local_shape
from shardspec.local import fingerprint
from shardspec.mesh import Mesh
from shardspec.placements import spec_to_placements
from shardspec.spec import P
from shardspec.spec_tree import keyed_like, mismatch

_SCALARS = (bool, int, float, str)

__all__ = ["Restored", "find", "load", "save"]


class Restored(NamedTuple):
    """What ``load`` returns: unpack as ``tree, step = load(...)`` or use the fields."""

    tree: Any
    step: int


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _usable(what: str) -> None:
    """A process group a step broke cannot run the save's or load's collectives (they would pair
    with a peer's collective still waiting from that step)."""
    if _distributed():
        from collectives.distributed import check_usable

        check_usable(what)


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _path_str(path: Sequence[Any]) -> str:
    return "tree" + "".join(f"[{k!r}]" for k in path)


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    paths, leaves, spec = optree.tree_flatten_with_path(cast(Any, tree), none_is_leaf=False)
    return [_path_str(p) for p in paths], list(leaves), spec


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process call; here that mode is intended, not a misconfiguration."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank, so ranks take the same branch (or raise the same error)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


FAILED = -1  # word 2 of the agreement vector of a rank whose own arguments were rejected


def _all_agree(
    what: str, error: ShardingError | None, text: str, values: list[tuple[str, Any]], timeout: float
) -> None:
    """Every rank raises the same way, or none does: an error on one rank, a different tree or step,
    or plain tensors whose values differ would otherwise hang DCP's collectives or lose data."""
    if not _distributed():
        if error is not None:
            raise error
        return
    prints = [fingerprint(v) if isinstance(v, torch.Tensor) else v for _, v in values]
    # word 0 names the call (a sharded step's check met here is told apart); FAILED: an error
    words = [digest(f"checkpoint.{what}"), digest(text), FAILED if error else digest(repr(prints))]
    everyone = disagreeing(torch.tensor(words), timeout, f"checkpoint.{what} (every rank must call it)")
    if error is not None:  # every rank's own mistake too, not only one that the others lack
        raise error
    if everyone is None:
        return
    other_calls(everyone, f"checkpoint.{what}", lambda word: word == words[0])
    failed = [r for r, v in enumerate(everyone) if int(v[2]) == FAILED]
    if failed:
        raise fail(
            f"checkpoint.{what}: rank(s) {failed} rejected their arguments (their error says why); "
            "nothing was written.",
            "give every rank the same arguments.",
        )
    if len({int(v[1]) for v in everyone}) > 1:
        raise fail(
            f"checkpoint.{what}: ranks passed different steps, paths, trees, shapes or dtypes: rank groups "
            f"{groups([v[1:2] for v in everyone])}; nothing was written or read.",
            "call it with the same arguments on every rank (every rank calls save and load).",
        )
    paths = [p for p, _ in values]
    listed = ", ".join(paths[:5]) + (" ..." if len(paths) > 5 else "")
    raise fail(
        f"checkpoint.{what}: plain tensors or scalars differ across ranks (rank groups "
        f"{groups([v[2:3] for v in everyone])}) among {listed}; "
        "a plain tensor is one global value, so only one rank's copy could be kept.",
        "save DTensors for per-rank data (shardspec.from_local), or pass identical values on every rank.",
    )


def _describe_leaf(path: str, leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, DTensor):
        if any(p.is_partial() for p in leaf.placements):
            raise fail(
                f"checkpoint.save: {path} is a DTensor with a pending reduction "
                f"(placements {tuple(leaf.placements)}); its value is not settled yet.",
                f"redistribute {path} to Shard/Replicate placements before saving.",
            )
        layout = str(tuple(leaf.placements))
    elif isinstance(leaf, torch.Tensor):
        layout = "global"
    elif isinstance(leaf, _SCALARS):
        return {"path": path, "kind": "scalar", "value": leaf}
    else:
        raise fail(
            f"checkpoint.save: {path} is a {type(leaf).__name__}; a checkpoint holds tensors, "
            "DTensors and Python bool/int/float/str leaves.",
            f"convert {path} to a tensor or a Python scalar, or keep it out of the saved tree.",
        )
    return {
        "path": path,
        "kind": "tensor",
        "shape": list(leaf.shape),
        "dtype": _dtype_name(leaf.dtype),
        "layout": layout,
    }


def save(
    path: str | os.PathLike[str], tree: Any, *, step: int, keep: int | None = 2, timeout: float = 600.0
) -> Path:
    """Save ``tree`` as checkpoint ``step`` under the root directory ``path``; return its directory.

    Every rank calls this in real mode (DCP writes each rank's shards once, replicated ones once in
    all). The data goes to ``.tmp-step-N`` first; only when DCP, the RNG states and the tree record
    are all on disk does rank 0 rename it to ``step-N`` and point ``latest`` at it, so a crash at any
    moment leaves the previous checkpoint as the newest complete one. ``keep`` published checkpoints
    stay (the new one included; ``None`` keeps all).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise fail(
            f"checkpoint.save(step={shown(step)}): step must be a non-negative int.",
            "pass the number of training steps done, e.g. step=100.",
        )
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise fail(
            f"checkpoint.save(keep={shown(keep)}): keep is how many checkpoints stay, an int >= 1 "
            "(the new one included).",
            "pass keep >= 1, or keep=None to keep every checkpoint.",
        )
    _usable("checkpoint.save")
    root = Path(path)
    paths, leaves, _ = _flatten(tree)
    records: list[dict[str, Any]] = []
    error = None
    try:
        records = [_describe_leaf(p, x) for p, x in zip(paths, leaves)]
    except ShardingError as exc:
        error = exc
    plain = [(p, x) for p, x in zip(paths, leaves) if not isinstance(x, DTensor)]
    _all_agree("save", error, repr((str(root.resolve()), step, records)), plain, timeout)
    rank = _rank()
    name = f"{PREFIX}{step:08d}"
    tmp = root / f"{TMP}{step:08d}"

    problem = None
    with contextlib.ExitStack() as held:
        if rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                held.enter_context(save_lock(root, timeout))
                recover(root)
                tmp.mkdir()
            except OSError as exc:
                problem = f"cannot prepare {tmp}: {exc}"
            except ShardingError as exc:
                problem = str(exc).split("\nFix: ")[0].removeprefix("checkpoint.save: ").rstrip(".")
        return _write(root, tmp, name, step, keep, rank, paths, leaves, records, problem)


def _write(
    root: Path,
    tmp: Path,
    name: str,
    step: int,
    keep: int | None,
    rank: int,
    paths: list[str],
    leaves: list[Any],
    records: list[dict[str, Any]],
    problem: str | None,
) -> Path:
    """The rest of ``save`` (under its lock on rank 0): every rank's data, then rank 0 publishes."""
    problem = _agree(problem)
    if problem is not None:
        raise fail(f"checkpoint.save: {problem}.", f"make {root} a writable directory.")

    torch.save(_rng_state(), tmp / f"rng-{rank}.pt")
    state = {p: x for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)}
    with _single_process_quiet(), dcp_errors("save", tmp):
        dcp_save(state, checkpoint_id=tmp, no_dist=not _distributed())
    sums: dict[str, str] = {}
    for part in gathered(checksums(tmp, owned_files(tmp, rank))):
        sums.update(part)

    if rank == 0:
        try:
            meta = {
                "format": FORMAT,
                "step": step,
                "world_size": dist.get_world_size() if _distributed() else 1,
                "leaves": records,
                "checksums": sums,
                "complete": True,
            }
            write_atomic(tmp / META, json.dumps(meta, indent=1))
            publish(root, tmp, name, keep)
        except OSError as exc:
            problem = f"cannot publish {tmp} as {root / name}: {exc}"
    problem = _agree(problem)  # no rank returns before the checkpoint is published
    if problem is not None:
        raise fail(f"checkpoint.save: {problem}.", f"check free space and permissions under {root}.")
    return root / name


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(ckpt: Path) -> None:
    """Each rank takes the state its rank saved; ranks beyond the saved world take rank 0's."""
    own = ckpt / f"rng-{_rank()}.pt"
    try:
        state = torch.load(own if own.exists() else ckpt / "rng-0.pt", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise fail(
            f"checkpoint.load(restore_rng=True): cannot read the RNG state in {ckpt} ({exc}).",
            "load with restore_rng=False, or from another checkpoint.",
        ) from None
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find(path: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``path`` (or ``path`` itself), or None: for resuming."""
    found, _, _ = resolve(Path(path))
    return found


def load(
    path: str | os.PathLike[str],
    *,
    like: Any,
    mesh: Mesh | None = None,
    specs: Any = None,
    restore_rng: bool = False,
    timeout: float = 600.0,
    verify: bool = True,
) -> Restored:
    """Load a checkpoint into the structure of ``like``; return ``Restored(tree, step)``.

    ``path`` is a checkpoint directory or a root (its newest complete checkpoint is taken).
    ``like`` supplies structure, shapes and dtypes only (tensors, DTensors or meta/empty stand-ins).
    On a real ``mesh`` every rank calls this and gets DTensors laid out by ``specs`` (a tree of ``P``
    matching ``like``, prefixes allowed; default replicated), whatever mesh or world size wrote the
    checkpoint: DCP reads each rank's block from the saved shards. With a simulated mesh or none,
    the result is global tensors. Python scalar leaves come back as saved. ``verify`` compares the
    files with the CRC-32 checksums the save recorded first (the ranks share the reading), so a
    damaged or swapped file is an error naming it rather than silently wrong values.
    """
    _usable("checkpoint.load")
    # every rank is here, in a load, before rank 0's view of the directory is broadcast (a step's
    # check met here is named, where the broadcast would leave this rank waiting)
    _all_agree("load", None, "start", [], timeout)
    ckpt, error, kind = _agree(resolve(Path(path)))
    if ckpt is None:
        fix = (
            "save a checkpoint there first, or pass the directory given to checkpoint.save"
            if kind == "missing"
            else "its save was interrupted; load the root directory to get the newest complete "
            "checkpoint, or save again"
        )
        raise fail(f"checkpoint.load: {error}.", fix + ".")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise fail(
            f"checkpoint.load(mesh=...) needs a shardspec.Mesh, got {type(mesh).__name__}.",
            "pass the mesh the step runs on (Mesh({'dp': 2}) under torchrun), or None for full tensors.",
        )
    meta = read_meta(ckpt)
    paths, leaves, treespec = _flatten(like)
    saved = {r["path"]: r for r in meta["leaves"]}
    real = mesh is not None and not mesh.simulated
    error = None
    leaf_specs: list[Any] = [P()] * len(paths)
    try:
        _check_structure(f"{ckpt} (step {meta['step']})", paths, leaves, saved)
        leaf_specs = _leaf_specs(specs, like, paths)
        if mesh is not None:
            for p, spec in zip(paths, leaf_specs):
                if saved[p]["kind"] == "tensor":
                    check_spec(tuple(saved[p]["shape"]), mesh, spec, name=f"checkpoint.load: specs for {p}")
    except ShardingError as exc:
        error = exc
    shapes = [
        (p, tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__)
        for p, x in zip(paths, leaves)
    ]
    _all_agree("load", error, repr((shapes, leaf_specs)), [], timeout)
    state: dict[str, Any] = {}
    for p, spec in zip(paths, leaf_specs):
        rec = saved[p]
        if rec["kind"] != "tensor":
            continue
        shape, dtype = tuple(rec["shape"]), getattr(torch, rec["dtype"])
        if real:
            assert mesh is not None
            placements = spec_to_placements(spec, mesh, shape, name=p)
            device = mesh.device_mesh.device_type
            block = torch.empty(local_shape(shape, mesh, spec, mesh.rank), dtype=dtype, device=device)
            state[p] = DTensor.from_local(
                block,
                mesh.device_mesh,
                list(placements),
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        else:
            state[p] = torch.empty(shape, dtype=dtype)
    if verify:
        verify_files(ckpt, meta)
    with _single_process_quiet(), dcp_errors("load", ckpt):
        dcp_load(state, checkpoint_id=ckpt, no_dist=not _distributed())
    if restore_rng:
        _restore_rng(ckpt)
    values = [state[p] if saved[p]["kind"] == "tensor" else saved[p]["value"] for p in paths]
    return Restored(optree.tree_unflatten(treespec, values), int(meta["step"]))


def _leaf_specs(specs: Any, like: Any, paths: list[str]) -> list[Any]:
    if specs is None:
        return [P()] * len(paths)
    try:
        return list(optree.broadcast_prefix(keyed_like(specs, like), like, none_is_leaf=False))
    except ValueError:
        where, detail = mismatch(specs, like, "like") or ("the top level", "the trees differ")
        raise fail(
            f"checkpoint.load: specs do not match the structure of like at {where}: {detail}.",
            "give specs the same tree as like, or a prefix of it (one P covers a whole subtree).",
        ) from None


def _check_structure(ckpt: str, paths: list[str], leaves: list[Any], saved: dict[str, Any]) -> None:
    missing = [p for p in paths if p not in saved]
    extra = [p for p in saved if p not in set(paths)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"in like but not in the checkpoint: {', '.join(missing)}")
        if extra:
            parts.append(f"in the checkpoint but not in like: {', '.join(extra)}")
        raise fail(
            f"checkpoint.load: {ckpt} and like have different trees; {'; '.join(parts)}.",
            "pass a like tree with the saved structure (same keys and nesting), or load a "
            "checkpoint written from this tree.",
        )
    for p, leaf in zip(paths, leaves):
        rec = saved[p]
        is_tensor = isinstance(leaf, torch.Tensor)
        if (rec["kind"] == "tensor") != is_tensor:
            have = f"a tensor of shape {tuple(rec['shape'])}" if rec["kind"] == "tensor" else "a scalar"
            raise fail(
                f"checkpoint.load: {p} is {have} in {ckpt}, but like has a {type(leaf).__name__}.",
                f"make {p} in like a {'tensor' if rec['kind'] == 'tensor' else 'Python scalar'}.",
            )
        if not is_tensor:
            continue
        shape, dtype = tuple(rec["shape"]), rec["dtype"]
        if tuple(leaf.shape) != shape:
            raise fail(
                f"checkpoint.load: {p} has shape {shape} ({dtype}) in {ckpt}, but like expects "
                f"{tuple(leaf.shape)} ({_dtype_name(leaf.dtype)}).",
                f"build like with the saved model sizes (shape {shape} for {p}), or load a "
                "checkpoint of this model.",
            )
        if _dtype_name(leaf.dtype) != dtype:
            raise fail(
                f"checkpoint.load: {p} is {dtype} in {ckpt}, but like expects "
                f"{_dtype_name(leaf.dtype)} (shape {shape}).",
                f"give like a {dtype} stand-in for {p} and cast after loading.",
            )
