"""Text picture of a sharding: which devices hold which block of a tensor."""

from __future__ import annotations

from collections.abc import Sequence

from shardspec.errors import fail, shown
from shardspec.layout import check_spec, chunk_bounds, device_slices, is_even
from shardspec.mesh import Mesh
from shardspec.spec import P


def visualize(shape: Sequence[int], mesh: Mesh, spec: P) -> str:
    """Show the blocks of a ``shape`` tensor under ``spec``.

    Up to two split dims: a grid, one cell per block listing the devices holding it (more than one
    when the block is replicated over unnamed axes). More split dims: one line per block. Uneven
    splits show each block's index range and size. Example::

        >>> print(visualize((8, 6), Mesh({"dp": 2, "tp": 4}, simulate=True), P("dp", "tp")))
    """
    if isinstance(getattr(shape, "shape", None), tuple):  # a tensor: its shape
        shape = tuple(shape.shape)  # type: ignore[attr-defined]
    try:
        shape = tuple(int(n) for n in shape)
    except (TypeError, ValueError):
        raise fail(
            f"visualize(shape={shown(shape)}): shape must be a sequence of ints.",
            "pass a tensor's shape, e.g. visualize(x.shape, mesh, P('dp')).",
        ) from None
    if not isinstance(mesh, Mesh):
        raise fail(f"visualize: mesh must be a shardspec.Mesh, got {type(mesh).__name__}.", "pass the mesh.")
    if not isinstance(spec, P):
        raise fail(f"visualize: spec must be a P(...), got {shown(spec)}.", "write e.g. P('dp', None).")
    check_spec(shape, mesh, spec, name=f"visualize(shape={shape})")
    split = [d for d in range(len(shape)) if spec.axes_of(d)]
    header = [f"shape {shape}, {mesh.describe()}, spec {spec}"]
    for d in split:
        axes = spec.axes_of(d)
        n = mesh.axis_size(axes)
        sizes = sorted({b - a for a, b in (chunk_bounds(shape[d], n, i) for i in range(n))}, reverse=True)
        kind = "even" if shape[d] % n == 0 else "uneven, torch.chunk"
        header.append(
            f"  dim {d} ({shape[d]}) split {n} ways over {' x '.join(axes)}: blocks of "
            f"{' / '.join(map(str, sizes))} ({kind})"
        )
    replicated = [a for a in mesh.axis_names if a not in spec.axes]
    if replicated:
        header.append(f"  replicated over {', '.join(replicated)}")
    holders = _holders(shape, mesh, spec)
    if len(split) > 2:
        body = [f"  {_ranges(key, split)} -> devices {_devs(devs)}" for key, devs in holders.items()]
        return "\n".join(header + body)
    show_size = not is_even(shape, mesh, spec)
    rows_dim = split[0] if len(split) == 2 or (split and split[0] == 0 and len(shape) > 1) else None
    cols_dim = split[-1] if split and split[-1] != rows_dim else None
    grid = _grid(shape, mesh, spec, holders, rows_dim, cols_dim, show_size)
    return "\n".join(line.rstrip() for line in header + grid)


Block = tuple[tuple[int, int, int], ...]  # per dim: start, stop, block index (empty blocks differ)


def _holders(shape: tuple[int, ...], mesh: Mesh, spec: P) -> dict[Block, list[int]]:
    out: dict[Block, list[int]] = {}
    for rank in range(mesh.size):
        slices = device_slices(shape, mesh, spec, rank)
        index = [mesh.axis_index(rank, spec.axes_of(d)) if spec.axes_of(d) else 0 for d in range(len(shape))]
        key = tuple((s.start, s.stop, i) for s, i in zip(slices, index, strict=True))
        out.setdefault(key, []).append(rank)
    return out


def _devs(devs: list[int]) -> str:
    return ",".join(map(str, devs))


def _ranges(key: Block, dims: list[int]) -> str:
    return "[" + ", ".join(f"{key[d][0]}:{key[d][1]}" for d in dims) + "]"


def _grid(
    shape: tuple[int, ...],
    mesh: Mesh,
    spec: P,
    holders: dict[Block, list[int]],
    rows_dim: int | None,
    cols_dim: int | None,
    show_size: bool,
) -> list[str]:
    def bounds(dim: int | None) -> list[tuple[int, int]]:
        if dim is None:
            return [(0, 0)]
        n = mesh.axis_size(spec.axes_of(dim))
        return [chunk_bounds(shape[dim], n, i) for i in range(n)]

    def label(dim: int | None, b: tuple[int, int]) -> str:
        if dim is None:
            return ""
        return f"{b[0]}:{b[1]}" + (f" ({b[1] - b[0]})" if show_size else "")

    def cell(ri: int, rb: tuple[int, int], ci: int, cb: tuple[int, int]) -> str:
        for key, devs in holders.items():
            if (rows_dim is None or key[rows_dim] == (*rb, ri)) and (
                cols_dim is None or key[cols_dim] == (*cb, ci)
            ):
                return "dev " + _devs(devs)
        return "-"

    row_bounds, col_bounds = bounds(rows_dim), bounds(cols_dim)
    cells = [[cell(ri, rb, ci, cb) for ci, cb in enumerate(col_bounds)] for ri, rb in enumerate(row_bounds)]
    col_labels = [label(cols_dim, cb) for cb in col_bounds]
    widths = [max(len(col_labels[j]), *(len(r[j]) for r in cells)) for j in range(len(col_bounds))]
    row_labels = [label(rows_dim, rb) for rb in row_bounds]
    lw = max(len(x) for x in row_labels)
    sep = " " * lw + " +" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [""]
    if cols_dim is not None:
        lines.append(" " * lw + "  " + " ".join(f" {lab:^{w}} " for lab, w in zip(col_labels, widths)))
    lines.append(sep)
    for rl, row in zip(row_labels, cells):
        lines.append(f"{rl:>{lw}} |" + "|".join(f" {c:^{w}} " for c, w in zip(row, widths)) + "|")
        lines.append(sep)
    return lines
