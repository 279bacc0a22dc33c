"""Real meshes: each pipeline stage's values live on the stage's sub-mesh.

A result computed by stage position ``q`` comes back as a DTensor on the DeviceMesh of the ranks at
``q`` along the pipeline axis (the other axes, in mesh order), the way torch lays out a tensor on a
sub-mesh: ranks outside it hold an empty local tensor. The next step takes such DTensors back as
they came out. Every rank builds every stage's sub-mesh in the same order (DeviceMesh creation
is collective), once per mesh and axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from collectives.ops import mesh_key
from shardspec.layout import device_slices
from shardspec.mesh import Mesh

if TYPE_CHECKING:
    from compiler.program import Program

_MESHES: dict[tuple[str, str], list[Any]] = {}


def stage_meshes(mesh: Mesh, axis: str) -> list[Any]:
    """The DeviceMesh of each position along ``axis`` (created on first use, then reused)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (mesh_key(mesh), axis)
    if key not in _MESHES:
        grid = torch.arange(mesh.size).reshape(mesh.sizes)
        dim = mesh.axis_names.index(axis)
        names = tuple(n for n in mesh.axis_names if n != axis) or (f"{axis}_stage",)
        kind = mesh.device_mesh.device_type
        _MESHES[key] = [
            DeviceMesh(
                kind,
                grid.select(dim, q).reshape([mesh.shape[n] for n in names if n in mesh.shape] or [1]),
                mesh_dim_names=names,
            )
            for q in range(mesh.axis_size(axis))
        ]
    return _MESHES[key]


def sub_placements(placements: Sequence[Any], mesh: Mesh, axis: str) -> tuple[Any, ...]:
    """A full-mesh placement list without the pipeline axis's entry (which is Replicate)."""
    from torch.distributed.tensor import Replicate

    dim = mesh.axis_names.index(axis)
    rest = tuple(p for d, p in enumerate(placements) if d != dim)
    return rest or (Replicate(),)


def on_stage_mesh(t: Any, meshes: Sequence[Any]) -> int | None:
    """Which stage's sub-mesh a DTensor lives on (None: another mesh)."""
    for q, m in enumerate(meshes):
        if t.device_mesh is m or (
            t.device_mesh.mesh.tolist() == m.mesh.tolist()
            and tuple(t.device_mesh.mesh_dim_names or ()) == tuple(m.mesh_dim_names or ())
        ):
            return q
    return None


def stage_input(t: Any, program: Program, index: int, want: Sequence[Any], path: str) -> torch.Tensor | None:
    """This rank's block of input ``index``, a DTensor on a stage's sub-mesh, when this rank's
    position reads it (an empty block when it does not).

    A value that positions other than its holder read (a weight two stages use: the step
    returned it on the sub-mesh of the one position that updated it) is broadcast along the
    pipeline axis from its holder. The decision depends only on the DTensor's mesh and the
    program, never on the rank, so every rank takes the same path (no rank waits on a
    collective another one skipped). Raises nothing for a DTensor on another mesh: None."""
    import torch.distributed as dist

    pp = program.pipeline
    assert pp is not None
    mesh, axis = program.mesh, pp.pipeline.axis
    meshes = stage_meshes(mesh, axis)
    s = on_stage_mesh(t, meshes)
    if s is None:
        return None
    coords = mesh.coords(mesh.rank)
    at = [mesh.rank_of({**coords, axis: q}) for q in range(len(meshes))]
    readers = {q for q in range(len(meshes)) if index in pp.per_rank[at[q]].reads}
    q = coords[axis]
    sub = sub_placements(want, mesh, axis)
    if q == s and tuple(t.placements) != sub:
        t = t.redistribute(meshes[s], list(sub))
    if readers <= {s}:  # read where it lives (or nowhere)
        return t.to_local() if q in readers else torch.empty(0, dtype=t.dtype)
    if q == s:
        block = t.to_local().contiguous()
    else:  # this rank's block under the wanted layout: the pipeline axis's entry is Replicate
        where = tuple(device_slices(t.shape, mesh, program.in_specs[index], mesh.rank))
        shape = torch.empty(t.shape, device="meta")[where].shape
        block = torch.empty(shape, dtype=t.dtype, device=t.device)
    dist.broadcast(block, src=at[s], group=mesh.device_mesh.get_group(axis))
    return block if q in readers else torch.empty(0, dtype=t.dtype)


def stage_results(
    program: Program,
    outs: Sequence[torch.Tensor | None],
    placements: Sequence[Sequence[Any]],
    shapes: Sequence[torch.Size],
    strides: Sequence[tuple[int, ...]],
) -> list[Any]:
    """Each result as a DTensor on the sub-mesh of the position that computed it, or on the whole
    mesh when every position holds it (a step counter every stage computes)."""
    from compiler.backend import wrap_results

    pp = program.pipeline
    assert pp is not None
    mesh, axis = program.mesh, pp.pipeline.axis
    meshes = stage_meshes(mesh, axis)
    p = len(meshes)
    first = [mesh.rank_of({**mesh.coords(mesh.rank), axis: q}) for q in range(p)]
    wrapped = []
    for i, out in enumerate(outs):
        holders = [q for q in range(p) if pp.per_rank[first[q]].outputs[i] == q]
        dtype = program.traced.outputs[i].dtype
        if len(holders) == p:
            assert out is not None
            wrapped += wrap_results([out], mesh.device_mesh, [placements[i]], [shapes[i]], [strides[i]])
            continue
        local = out if out is not None else torch.empty(0, dtype=dtype)
        sub = sub_placements(placements[i], mesh, axis)
        wrapped += wrap_results([local], meshes[holders[0]], [sub], [shapes[i]], [strides[i]])
    return wrapped
