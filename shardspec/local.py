"""``from_local``: DTensors from the block each rank already holds (real meshes).

On a real mesh a plain tensor passed to a sharded step means the full global value on every rank. A
data loader that gives each rank its own slice of the batch (the DDP habit) should say so instead:
``from_local(batch, P("dp"), mesh)`` wraps each rank's block as a DTensor of the global shape, which the
step then uses as is, without any rank ever holding the global batch (as JAX's
``make_array_from_process_local_data`` does).
"""

from __future__ import annotations

from typing import Any, cast

import optree
import torch

from shardspec.errors import fail
from shardspec.layout import check_spec, local_shape
from shardspec.mesh import Mesh
from shardspec.spec import P


def _path(path: tuple[Any, ...]) -> str:
    return "tree" + "".join(f"[{k!r}]" for k in path)


def from_local(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """Wrap each rank's own block of every tensor in ``tree`` as a DTensor laid out by ``specs``.

    ``specs`` is a tree of ``P`` matching ``tree`` (a prefix covers a subtree). The global size of a
    split dim is the sum of the blocks along its axes; every rank's block must be the one
    ``torch.chunk`` gives it (shorter tail blocks allowed), and replicated dims must agree. One
    metadata exchange (shapes only) checks this on every rank.
    """
    from torch.distributed.tensor import DTensor

    from shardspec.placements import spec_to_placements

    if not isinstance(mesh, Mesh):
        raise fail(
            f"from_local: mesh must be a shardspec.Mesh, got {type(mesh).__name__}.", "pass the step's mesh."
        )
    if mesh.simulated:
        raise fail(
            f"from_local needs a real mesh; {mesh.describe()} is simulated, where steps take global tensors.",
            "pass global tensors on a simulated mesh (shardspec.unshard(blocks, mesh, spec) builds one "
            "from per-device blocks).",
        )
    paths, leaves, treedef = optree.tree_flatten_with_path(cast(Any, tree), none_is_leaf=False)
    try:
        leaf_specs = list(
            optree.broadcast_prefix(specs, optree.tree_unflatten(treedef, leaves), none_is_leaf=False)
        )
    except ValueError as exc:
        raise fail(
            f"from_local: specs {optree.tree_structure(specs, none_is_leaf=False)} do not match the tree "
            f"{treedef} ({str(exc).split('; dict:')[0][:300]}).",
            "give specs the same tree as the values, or a prefix of it.",
        ) from None
    mine = []
    for path, leaf, spec in zip(paths, leaves, leaf_specs, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise fail(
                f"from_local: {_path(path)} is a {type(leaf).__name__}, not a tensor.", "pass tensors only."
            )
        check_spec(None, mesh, spec, name=_path(path), ndim=leaf.dim())
        mine.append(tuple(leaf.shape))
    everyone = _exchange_shapes(mine, mesh)
    out = []
    for i, (path, leaf, spec) in enumerate(zip(paths, leaves, leaf_specs, strict=True)):
        shape = _global_shape(i, _path(path), spec, mesh, everyone)
        placements = spec_to_placements(spec, mesh, shape, name=_path(path))
        stride = torch.empty(shape, device="meta").stride()
        out.append(
            DTensor.from_local(
                leaf.contiguous(),
                mesh.device_mesh,
                list(placements),
                run_check=False,
                shape=torch.Size(shape),
                stride=stride,
            )
        )
    return optree.tree_unflatten(treedef, out)


def _exchange_shapes(mine: list[tuple[int, ...]], mesh: Mesh) -> list[list[tuple[int, ...]]]:
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    lengths = {len(e) for e in everyone}
    if len(lengths) > 1:
        raise fail(
            f"from_local: ranks passed trees with different numbers of tensors ({sorted(lengths)}).",
            "pass the same tree structure on every rank.",
        )
    return cast(list[list[tuple[int, ...]]], everyone)


def _global_shape(
    i: int, where: str, spec: P, mesh: Mesh, everyone: list[list[tuple[int, ...]]]
) -> tuple[int, ...]:
    shapes = [e[i] for e in everyone]
    if len({len(s) for s in shapes}) > 1:
        raise fail(
            f"from_local: {where} has different ranks on different ranks: {shapes}.",
            "pass blocks of one rank.",
        )
    ndim = len(shapes[0])
    shape = []
    for d in range(ndim):
        axes = spec.axes_of(d) if d < len(spec) else ()
        group = mesh.group_of(0, axes) if axes else [0]
        shape.append(sum(shapes[r][d] for r in group))
    for r, s in enumerate(shapes):
        want = local_shape(shape, mesh, spec, r)
        if tuple(s) != tuple(want):
            raise fail(
                f"from_local: {where} on rank {r} has shape {tuple(s)}, but spec {spec} of the global shape "
                f"{tuple(shape)} (summed over the split axes) gives that rank {tuple(want)}.",
                "give each rank its torch.chunk block of the global tensor (equal blocks, shorter tail "
                "blocks last), with replicated dims the same size on every rank.",
            )
    return tuple(shape)
