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
from shardspec.spec_tree import keyed_like, mismatch


def _path(path: tuple[Any, ...]) -> str:
    return "tree" + "".join(f"[{k!r}]" for k in path)


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """Two integer sums over a tensor's bits, weighted by position: equal on every rank that holds the
    same bits, whatever the thread count (integer sums do not depend on order). Bitwise on purpose:
    ``-0.0`` and ``0.0`` are different inputs to a program."""
    if t.device.type == "meta":
        return (0, 0)
    data = t.detach()
    if data.layout != torch.strided:
        data = data.to_dense()
    data = data.resolve_conj().resolve_neg().contiguous().reshape(-1)
    nbytes = data.numel() * data.element_size()
    words = (data.view(torch.uint8) if nbytes % 4 else data.view(torch.int32)).to(torch.int64)
    index = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    weights = (index * 0x9E3779B1) % 2147483647 + 1
    return int(words.sum()), int((words * weights).sum())


def from_local(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """Wrap each rank's own block of every tensor in ``tree`` as a DTensor laid out by ``specs``.

    ``specs`` is a tree of ``P`` matching ``tree`` (a prefix covers a subtree). The global size of a
    split dim is the sum of the blocks along its axes; every rank's block must be the one
    ``torch.chunk`` gives it (shorter tail blocks allowed), and replicated dims must agree. One
    metadata exchange (shapes only) checks this on every rank. Example (under torchrun)::

        batch = from_local(my_rows, P("dp"), mesh)  # this rank's rows of the global batch
        params, state, loss = step(params, state, batch)
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
        leaf_specs = list(optree.broadcast_prefix(keyed_like(specs, tree), tree, none_is_leaf=False))
    except ValueError:
        where, detail = mismatch(specs, tree, "tree") or ("the top level", "the trees differ")
        raise fail(
            f"from_local: specs do not match the structure of the values at {where}: {detail}.",
            "give specs the same tree as the values, or a prefix of it (one P covers a whole subtree).",
        ) from None
    mine = []
    for path, leaf, spec in zip(paths, leaves, leaf_specs, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise fail(
                f"from_local: {_path(path)} is a {type(leaf).__name__}, not a tensor.", "pass tensors only."
            )
        check_spec(None, mesh, spec, name=_path(path), ndim=leaf.dim())
        mine.append((tuple(leaf.shape), str(leaf.dtype), fingerprint(leaf)))
    everyone = _exchange(mine, mesh)
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


Block = tuple[tuple[int, ...], str, tuple[int, int]]  # shape, dtype, fingerprint


def _exchange(mine: list[Block], mesh: Mesh) -> list[list[Block]]:
    import torch.distributed as dist

    from collectives.distributed import check_usable

    check_usable("shardspec.from_local")

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    lengths = {len(e) for e in everyone}
    if len(lengths) > 1:
        raise fail(
            f"from_local: ranks passed trees with different numbers of tensors ({sorted(lengths)}).",
            "pass the same tree structure on every rank.",
        )
    return cast(list[list[Block]], everyone)


def _global_shape(i: int, where: str, spec: P, mesh: Mesh, everyone: list[list[Block]]) -> tuple[int, ...]:
    shapes = [e[i][0] for e in everyone]
    dtypes = sorted({e[i][1] for e in everyone})
    if len(dtypes) > 1:
        raise fail(
            f"from_local: {where} has dtypes {dtypes} on different ranks.", "pass one dtype on every rank."
        )
    if len({len(s) for s in shapes}) > 1:
        raise fail(
            f"from_local: {where} has a different number of dims on different ranks: {shapes}.",
            "give every rank a block with the same number of dims.",
        )
    ndim = len(shapes[0])
    split = [spec.axes_of(d) if d < len(spec) else () for d in range(ndim)]
    shape = []
    for d in range(ndim):
        group = mesh.group_of(0, split[d]) if split[d] else [0]
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
    holders: dict[tuple[int, ...], list[int]] = {}
    for r in range(len(everyone)):
        holders.setdefault(tuple(mesh.axis_index(r, axes) for axes in split if axes), []).append(r)
    for ranks in holders.values():
        if len({everyone[r][i][2] for r in ranks}) > 1:
            replicated = [a for a in mesh.axis_names if all(a not in axes for axes in split)]
            used = [a for a in mesh.axis_names if a not in replicated]
            raise fail(
                f"from_local: {where} differs between ranks {ranks}, which hold the same block (spec {spec} "
                f"replicates it over {replicated}). A loader that shards the data by global rank instead "
                "of by the split axes gives them different data, and part of the batch would be lost.",
                f"give the ranks along {replicated} the same block (shard the data over {used} only), "
                "or split it over those axes too.",
            )
    return tuple(shape)


def to_global(tree: Any) -> Any:
    """``tree`` with each DTensor (a real mesh's step result) replaced by its global value, on
    every rank; other leaves (a simulated mesh's results are global already) as they are.

    A pipelined step's result lives on the sub-mesh of the stage that computed it, and ranks
    outside it hold nothing (``full_tensor()`` gives them an empty tensor): its first rank
    broadcasts the value to all. Every rank must call it, on the same tree (a collective)."""
    return optree.tree_map(_to_global, tree, none_is_leaf=False)


def _to_global(x: Any) -> Any:
    if not hasattr(x, "full_tensor") or not hasattr(x, "device_mesh"):
        return x
    import torch.distributed as dist

    from collectives.distributed import check_usable

    check_usable("shardspec.to_global")

    ranks = x.device_mesh.mesh.flatten().tolist()
    if len(ranks) == dist.get_world_size():
        return _own(x.full_tensor(), x)
    mine = dist.get_rank() in ranks
    value = (
        _own(x.full_tensor(), x) if mine else torch.empty(x.shape, dtype=x.dtype, device=x.to_local().device)
    )
    dist.broadcast(value, src=ranks[0])
    return value


def _own(value: torch.Tensor, x: Any) -> torch.Tensor:
    """``value`` in storage of its own: a replicated DTensor's ``full_tensor()`` is its local tensor
    itself, which a later step donating ``x`` (or this value) would overwrite under the caller."""
    local = x._local_tensor
    if value.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() and local.numel():
        return value.clone()
    return value
