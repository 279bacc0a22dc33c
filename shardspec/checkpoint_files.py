"""The on-disk layout of a checkpoint root and its crash-safe publication.

    DIR/step-00000040/   a complete checkpoint: DCP files, shardspec.json, rng-<rank>.pt
    DIR/latest           the name of the newest published checkpoint (replaced atomically)
    DIR/.tmp-step-N/     a save in progress, or one that crashed (never loaded)
    DIR/.old-step-N/     a complete checkpoint moved aside while the same step is saved again

Only complete directories are ever loaded; a save writes aside and publishes by rename, so a crash at
any moment leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardspec.errors import fail

META = "shardspec.json"
FORMAT = "shardspec-checkpoint/1"
LATEST = "latest"
LOCK = ".save-lock"
PREFIX, TMP, OLD = "step-", ".tmp-step-", ".old-step-"


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (best effort: not every platform opens directories)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write a whole file or nothing: a reader sees the old content or the new, never a torn one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def recover(root: Path) -> None:
    """Clear what crashed saves left: a complete checkpoint moved aside by a re-save of its step goes
    back in place when its replacement never landed; everything else was never loadable."""
    for old in root.glob(OLD + "*"):
        final = root / (PREFIX + old.name.removeprefix(OLD))
        if not final.exists() and not _missing(old):
            os.rename(old, final)
        else:
            shutil.rmtree(old)
    for stale in root.glob(TMP + "*"):
        shutil.rmtree(stale)
    for torn in root.glob(LATEST + ".*.tmp"):  # a pointer write killed before its rename
        torn.unlink(missing_ok=True)


@contextlib.contextmanager
def save_lock(root: Path, timeout: float) -> Iterator[None]:
    """One save at a time under ``root`` (another process's, or another thread's): a save clears
    the temporary directories crashed saves left, which would delete one still being written."""
    import fcntl
    import time

    with open(root / LOCK, "a") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise fail(
                        f"checkpoint.save: another save has been writing under {root} for over "
                        f"{timeout:.0f} s.",
                        "let it finish, or save to another directory.",
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def publish(root: Path, tmp: Path, name: str, keep: int | None) -> None:
    final = root / name
    if final.exists():  # saving the same step again: the new data wins
        trash = root / f"{OLD}{name.removeprefix(PREFIX)}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    write_atomic(root / LATEST, name + "\n")
    if keep is not None:
        others = sorted((d for d in _complete_dirs(root) if d != final), key=_step_of, reverse=True)
        for old in others[keep - 1 :]:
            shutil.rmtree(old, ignore_errors=True)


def _step_of(d: Path) -> int:
    return int(d.name.removeprefix(PREFIX).removeprefix(OLD))


def _missing(d: Path) -> list[str]:
    """What a complete checkpoint has that ``d`` lacks (empty when complete): DCP's metadata, the
    tree record with its completion mark, and every saving rank's RNG state."""
    missing = [f for f in (".metadata", META) if not (d / f).is_file()]
    if not missing:
        try:
            meta = json.loads((d / META).read_text())
            if meta.get("complete") is not True:
                missing.append("the completion mark in " + META)
            world = int(meta.get("world_size", 1))
            missing += [f"rng-{r}.pt" for r in range(world) if not (d / f"rng-{r}.pt").is_file()]
        except (OSError, ValueError, TypeError, AttributeError):
            missing.append("a readable " + META)
    return missing


def _complete_dirs(root: Path) -> list[Path]:
    return [
        d
        for d in root.glob(PREFIX + "*")
        if d.is_dir() and d.name.removeprefix(PREFIX).isdigit() and not _missing(d)
    ]


def resolve(path: Path) -> tuple[Path | None, str | None, str]:
    """(checkpoint dir, None, "") or (None, what is wrong, kind) with kind "missing"/"incomplete"."""
    if not path.is_dir():
        return None, f"no checkpoint at {path}: the directory does not exist", "missing"
    if (path / META).exists() or (path / ".metadata").exists() or path.name.startswith(TMP):
        missing = _missing(path)
        if not missing:
            return path, None, ""
        return None, f"checkpoint {path} is incomplete: it lacks {', '.join(missing)}", "incomplete"
    pointer = path / LATEST
    with contextlib.suppress(OSError, ValueError):  # a damaged pointer: the newest complete step
        named = path / pointer.read_text().strip()
        if named.name and named.is_dir() and not _missing(named):
            return named, None, ""
    complete = _complete_dirs(path)
    aside = [d for d in path.glob(OLD + "*") if not _missing(d)]  # a re-save crashed mid-rename
    complete += [d for d in aside if not (path / (PREFIX + d.name.removeprefix(OLD))).exists()]
    if complete:
        return max(complete, key=_step_of), None, ""
    partial = sorted(d.name for d in path.iterdir() if d.name.startswith((TMP, PREFIX)))
    if partial:
        return None, f"{path} holds only incomplete checkpoints ({', '.join(partial)})", "incomplete"
    return None, f"no checkpoint at {path}: no {PREFIX}N directory and no {LATEST} file", "missing"


def owned_files(directory: Path, rank: int) -> list[str]:
    """The files of a just-written checkpoint that ``rank`` checksums: the DCP shard files it wrote
    (DCP names them ``__<rank>_<n>.distcp``) and its RNG state; rank 0 also takes DCP's metadata and
    any file no rank's name claims."""
    names = sorted(f.name for f in directory.iterdir() if f.is_file() and f.name != META)
    mine = [n for n in names if n.startswith(f"__{rank}_") or n == f"rng-{rank}.pt"]
    if rank == 0:
        claimed = {n for n in names if (n.startswith("__") and n.endswith(".distcp")) or n.startswith("rng-")}
        mine += [n for n in names if n not in claimed]
    return sorted(set(mine))


def checksums(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """CRC-32 of each named file (8 hex digits): recorded at save and compared before a load, so a
    damaged or swapped shard file is an error instead of silently wrong tensors (DCP reads raw
    bytes and checks nothing). A file that cannot be read gets ``"unreadable"``."""
    out = {}
    for name in names:
        crc = 0
        try:
            with open(directory / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    crc = zlib.crc32(chunk, crc)
        except OSError:
            out[name] = "unreadable"
            continue
        out[name] = f"{crc:08x}"
    return out


def damaged(ckpt: Path, recorded: dict[str, str], names: Iterable[str]) -> list[str]:
    """Which of ``names`` no longer match ``recorded``, each described (for the load error)."""
    found = checksums(ckpt, names)
    return [
        f"{n} (CRC-32 {recorded[n]} when saved, {found[n]} now)"
        if found[n] != "unreadable"
        else f"{n} (missing or unreadable)"
        for n in sorted(found)
        if found[n] != recorded[n]
    ]


def earlier(ckpt: Path) -> Path | None:
    """The newest complete checkpoint beside ``ckpt`` with a lower step (what to load instead)."""
    if not ckpt.name.startswith(PREFIX) or not ckpt.name.removeprefix(PREFIX).isdigit():
        return None
    older = [d for d in _complete_dirs(ckpt.parent) if _step_of(d) < _step_of(ckpt)]
    return max(older, key=_step_of) if older else None


def gathered(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def verify_files(ckpt: Path, meta: dict[str, Any]) -> None:
    """Compare the checkpoint's files with the checksums its save recorded (each rank a share of the
    files); every rank raises the same error when one differs."""
    recorded = meta.get("checksums")
    if not isinstance(recorded, dict):
        return  # written before checksums were recorded
    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    names = sorted(recorded)[rank::world]
    bad = sorted(b for part in gathered(damaged(ckpt, recorded, names)) for b in part)
    if bad:
        before = earlier(ckpt)
        raise fail(
            f"checkpoint.load: {ckpt} is damaged: {len(bad)} file(s) differ from what its save wrote: "
            + ", ".join(bad[:3])
            + (" ..." if len(bad) > 3 else "")
            + ".",
            (f"load the previous checkpoint, {before}, " if before else "load another checkpoint ")
            + "or restore the files from a copy (verify=False reads them anyway, at your own risk).",
        )


def _leaf_record(r: Any) -> bool:
    """A leaf's record as save writes it: a path, and a tensor's shape and dtype or a scalar's value."""
    if not isinstance(r, dict) or not isinstance(r.get("path"), str):
        return False
    if r.get("kind") == "tensor":
        return isinstance(r.get("shape"), list) and isinstance(r.get("dtype"), str)
    return r.get("kind") == "scalar" and "value" in r


def read_meta(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's own record, checked: a foreign or damaged file is named, not a KeyError."""
    try:
        meta = json.loads((ckpt / META).read_text())
        ok = isinstance(meta, dict) and isinstance(meta.get("leaves"), list) and "step" in meta
        ok = ok and all(_leaf_record(r) for r in meta["leaves"])
        sums = meta.get("checksums", {})  # absent in records written before checksums
        ok = (
            ok
            and isinstance(sums, dict)
            and all(isinstance(v, str) and "/" not in k for k, v in sums.items())
        )
    except (OSError, ValueError):
        meta, ok = None, False
    if not ok or not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise fail(
            f"checkpoint.load: {ckpt / META} is not a {FORMAT} record"
            + (
                f" (its format is {found!r})"
                if found not in (None, FORMAT)
                else " (unreadable or incomplete)"
            )
            + ".",
            "load a directory written by shardspec.checkpoint.save (of this version), or save again.",
        )
    return meta


@contextlib.contextmanager
def dcp_errors(what: str, where: Path) -> Iterator[None]:
    """torch.distributed.checkpoint's failure (a damaged or missing shard file, a tensor it cannot
    write) as a ShardingError: its own exception derives from BaseException, past ``except Exception``.
    DCP gathers a failure to every rank, so every rank raises."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = sorted(exc.failures.items())
        first = (
            " ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in failures[:2])
            or str(exc)[:200]
        )
        raise fail(
            f"checkpoint.{what}: torch.distributed.checkpoint failed on {where}: {first}",
            "check that the directory is complete and readable (a damaged checkpoint cannot be "
            "loaded: load an earlier one), and that every leaf is a CPU or CUDA tensor with data.",
        ) from None
