"""What every example shares: ``--mesh dp=2,tp=2`` arguments, real-or-simulated mode, and printing.

An example runs *real* (one process per device, torch.distributed) when it was started by torchrun
(``WORLD_SIZE`` is set) or with ``--real``, and *simulated* (virtual devices in this process)
otherwise or with ``--simulate``; it always says which.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardspec import Mesh, ShardingError, to_global


def parse_mesh(text: str) -> dict[str, int]:
    """``dp=2,tp=2`` -> {"dp": 2, "tp": 2}."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip().isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: write axes as name=size pairs, e.g. dp=2,tp=2")
        if name.strip() in axes:
            raise argparse.ArgumentTypeError(f"{text!r} names axis {name.strip()!r} twice")
        axes[name.strip()] = int(size)
    return axes


def positive(text: str) -> int:
    """An argparse type: an int of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def run(main: Callable[[], Any]) -> None:
    """Run an example's ``main()``; a usage mistake the library reports (``ShardingError``: a mesh
    that does not fit the world, microbatches that do not split the batch, ...) is printed as
    argparse prints its errors, without an internal traceback, and exits with status 2."""
    try:
        main()
    except ShardingError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def parser(doc: str | None, default_mesh: str) -> argparse.ArgumentParser:
    """An argument parser with ``--mesh``, ``--real`` and ``--simulate`` (unknown flags are errors)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--mesh", type=parse_mesh, default=parse_mesh(default_mesh), help=f"axes (default {default_mesh})"
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--real", action="store_true", help="one process per device (under torchrun)")
    mode.add_argument("--simulate", action="store_true", help="virtual devices in this process")
    return ap


def make_mesh(args: argparse.Namespace) -> Mesh:
    """The mesh the arguments ask for: real under torchrun or with --real, else simulated."""
    real = args.real or (not args.simulate and "WORLD_SIZE" in os.environ)
    return Mesh(args.mesh, simulate=not real)


def say_fn(mesh: Mesh) -> Callable[..., None]:
    """``print`` on rank 0 (or in a simulated run), silent elsewhere."""
    if mesh.simulated or mesh.rank == 0:
        return print
    return lambda *a, **k: None


def mode_line(mesh: Mesh, extra: str = "") -> str:
    """Says whether this run is real or simulated, and on what (``extra`` is added to a real run's)."""
    if mesh.simulated:
        return f"mode: simulated ({mesh.describe()}: {mesh.size} virtual devices in one process)"
    backend = torch.distributed.get_backend()
    return f"mode: real ({mesh.describe()}: {mesh.size} processes, {backend}{extra})"


def spec_table(params: Mapping[str, torch.Tensor], specs: Mapping[str, Any], mesh: Mesh) -> str:
    """One row per parameter: name, global shape, spec, and the block each device holds."""
    from shardspec import local_shape

    rows = [("parameter", "shape", "spec", "per device")]
    for name, t in params.items():
        spec = specs[name]
        local = local_shape(tuple(t.shape), mesh, spec, 0)
        rows.append((name, _shape(t.shape), str(spec), _shape(local)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _shape(shape: Any) -> str:
    return str(tuple(int(s) for s in shape))


def full(x: Any) -> Any:
    """A global tensor from a step's result (``shardspec.to_global``: every rank calls it, in the
    same order)."""
    return to_global(x)


def max_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest elementwise difference between two parameter dicts of the same keys."""
    return max(float((full(a[k]) - full(b[k])).abs().max()) for k in a)
