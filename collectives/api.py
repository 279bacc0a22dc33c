"""The public collectives: validate the call, then run the custom op (or, in list mode, the kernels).

``axis`` is one mesh axis name or a tuple of names (one group over their product, first name major).
Called with one tensor, a collective is one rank's view of an SPMD program: in a real run, this
process's tensor; inside ``run_simulated``, one virtual device's. Called with a list of ``mesh.size``
tensors on a simulated mesh (list mode), it takes every device's tensor and returns every device's
result, indexed by rank.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TypeVar, overload

import torch

from collectives import kernels, ops, simulated
from shardspec.errors import fail, shown
from shardspec.mesh import Mesh

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)
T = TypeVar("T", torch.Tensor, list[torch.Tensor])
Axis = str | tuple[str, ...]


def _not_traced(kind: str) -> None:
    """A collective called by a sharded step's own code: the step's collectives come from its specs
    (the same error as a traced one gets, here at once: under ``value_and_grad`` torch.func would
    first fail on the op's missing derivative)."""
    runtime = sys.modules.get("compiler.runtime")
    tracing = runtime._TRACING.get() if runtime is not None else None
    if tracing is not None:
        axis = tracing.axis_names[0]
        where = sys.modules["compiler.sources"].user_frame()
        raise fail(
            f"collectives.{kind} at {where} is one of shardspec's own collectives, called inside a "
            "sharded step: "
            "the step's collectives come from its specs, so it cannot be placed.",
            "drop the collective and say the layout you want instead: constrain(x, P()) for a value "
            f"whole on every device (a pending sum is reduced there), or constrain(x, P({axis!r})) to "
            "split it.",
        )


def _norm_axes(kind: str, axis: Axis, mesh: Mesh) -> tuple[str, ...]:
    _not_traced(kind)
    if not isinstance(mesh, Mesh):
        raise fail(
            f"{kind}: mesh= must be a shardspec.Mesh, got {type(mesh).__name__}.",
            "pass the Mesh the tensors are laid out on.",
        )
    axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
    if not axes or not all(isinstance(a, str) for a in axes):
        raise fail(
            f"{kind}: axis={axis!r} is not a mesh axis name or a tuple of names.",
            f"use one of {list(mesh.axis_names)} or a tuple of them.",
        )
    for a in axes:
        if a not in mesh.shape:
            raise fail(
                f"{kind}: axis {a!r} is not an axis of {mesh.describe()}.",
                f"use one of {list(mesh.axis_names)}.",
            )
    if len(set(axes)) != len(axes):
        raise fail(f"{kind}: axis={axis!r} names an axis twice.", "name each axis once.")
    return axes


def _check_tensor(kind: str, x: torch.Tensor, op: str | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise fail(
            f"{kind}: expected a tensor, got {type(x).__name__}.",
            "pass a torch.Tensor (or, on a simulated mesh, a list with one per device).",
        )
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise fail(
            f"{kind}: dtype {str(x.dtype).replace('torch.', '')} is not supported (supported: {names}).",
            "cast first, e.g. x.to(torch.float32), and back after.",
        )
    if op is not None:
        if op not in kernels.REDUCE_OPS:
            raise fail(
                f"{kind}: op={op!r} is not a reduction this library runs.",
                f"use one of {list(kernels.REDUCE_OPS)}.",
            )
        if op == "avg" and not x.dtype.is_floating_point:
            raise fail(
                f"{kind}: op='avg' on {x.dtype} would need a rounding rule.",
                "use op='sum' and divide, or cast to a floating dtype.",
            )


def _check_size(kind: str, size: Any) -> None:
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise fail(
            f"{kind}: size={shown(size)} is not a global length (an int >= 0, or None).",
            "pass the global length along the joined dim, or omit it.",
        )


def _check_dim(kind: str, name: str, dim: int, x: torch.Tensor) -> int:
    if x.dim() == 0:
        raise fail(
            f"{kind}: a 0-dim tensor has no dim to split or join along ({name}={dim!r}).",
            "reshape it to 1-dim first (x.reshape(1)), or use all_reduce.",
        )
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise fail(
            f"{kind}: {name}={dim!r} is out of range for a tensor of shape {tuple(x.shape)}.",
            f"use a dim in {-x.dim()}..{x.dim() - 1}.",
        )
    return dim % x.dim()


def _dispatch(
    kind: str, x: Any, mesh: Mesh, axes: tuple[str, ...], params: dict[str, Any], op_call: Any, check: Any
) -> Any:
    if isinstance(x, (list, tuple)):
        if not mesh.simulated:
            raise fail(
                f"{kind}: a list of per-device tensors needs a simulated mesh; {mesh!r} is real.",
                "pass this rank's tensor.",
            )
        if len(x) != mesh.size:
            raise fail(
                f"{kind}: got {len(x)} tensors for {mesh.describe()} ({mesh.size} devices).",
                "pass one tensor per device, in rank order.",
            )
        for t in x:
            check(t)
        return simulated.evaluate_all(kind, mesh, axes, list(x), params)
    check(x)
    return op_call(x)


@overload
def all_gather(
    x: torch.Tensor, *, dim: int, axis: Axis, mesh: Mesh, size: int | None = ..., async_op: bool = ...
) -> torch.Tensor: ...
@overload
def all_gather(
    x: Sequence[torch.Tensor],
    *,
    dim: int,
    axis: Axis,
    mesh: Mesh,
    size: int | None = ...,
    async_op: bool = ...,
) -> list[torch.Tensor]: ...
def all_gather(
    x: Any, *, dim: int, axis: Axis, mesh: Mesh, size: int | None = None, async_op: bool = False
) -> Any:
    """Concatenate the group's shards along ``dim`` on every member.

    ``size`` is the global length along ``dim``; give it for uneven shards in a real run (without it
    the members first exchange their lengths). ``async_op`` returns at once; ``wait`` the result.
    """
    axes = _norm_axes("all_gather", axis, mesh)
    first = x[0] if isinstance(x, (list, tuple)) and x else x
    _check_tensor("all_gather", first)
    d = _check_dim("all_gather", "dim", dim, first)
    _check_size("all_gather", size)
    key = ops.mesh_key(mesh)
    return _dispatch(
        "all_gather",
        x,
        mesh,
        axes,
        {"dim": d, "size": size},
        lambda t: torch.ops.shardspec.all_gather(
            t, dim=d, axis=",".join(axes), mesh=key, size=-1 if size is None else size, async_op=async_op
        ),
        lambda t: _check_tensor("all_gather", t),
    )


def reduce_scatter(
    x: Any, *, dim: int, axis: Axis, mesh: Mesh, op: str = "sum", async_op: bool = False
) -> Any:
    """Reduce over the group, then give member ``i`` block ``i`` (torch.chunk layout) along ``dim``."""
    axes = _norm_axes("reduce_scatter", axis, mesh)
    first = x[0] if isinstance(x, (list, tuple)) and x else x
    _check_tensor("reduce_scatter", first, op)
    d = _check_dim("reduce_scatter", "dim", dim, first)
    key = ops.mesh_key(mesh)
    return _dispatch(
        "reduce_scatter",
        x,
        mesh,
        axes,
        {"dim": d, "op": op},
        lambda t: torch.ops.shardspec.reduce_scatter(
            t, dim=d, axis=",".join(axes), mesh=key, op=op, async_op=async_op
        ),
        lambda t: _check_tensor("reduce_scatter", t, op),
    )


def all_reduce(x: Any, *, axis: Axis, mesh: Mesh, op: str = "sum", async_op: bool = False) -> Any:
    """Every member gets the reduction (sum, avg, max, min) of the group's tensors."""
    axes = _norm_axes("all_reduce", axis, mesh)
    first = x[0] if isinstance(x, (list, tuple)) and x else x
    _check_tensor("all_reduce", first, op)
    key = ops.mesh_key(mesh)
    return _dispatch(
        "all_reduce",
        x,
        mesh,
        axes,
        {"op": op},
        lambda t: torch.ops.shardspec.all_reduce(t, axis=",".join(axes), mesh=key, op=op, async_op=async_op),
        lambda t: _check_tensor("all_reduce", t, op),
    )


def all_to_all(
    x: Any, *, split_dim: int, concat_dim: int, axis: Axis, mesh: Mesh, size: int | None = None
) -> Any:
    """Member ``j`` gets block ``j`` of every member's ``split_dim``, concatenated along ``concat_dim``.

    This is the Shard(concat_dim) -> Shard(split_dim) reshard. ``size`` is the global length along
    ``concat_dim``, needed only for uneven shards in a real run (else exchanged first).
    """
    axes = _norm_axes("all_to_all", axis, mesh)
    first = x[0] if isinstance(x, (list, tuple)) and x else x
    _check_tensor("all_to_all", first)
    sd = _check_dim("all_to_all", "split_dim", split_dim, first)
    cd = _check_dim("all_to_all", "concat_dim", concat_dim, first)
    _check_size("all_to_all", size)
    key = ops.mesh_key(mesh)
    return _dispatch(
        "all_to_all",
        x,
        mesh,
        axes,
        {"split_dim": sd, "concat_dim": cd, "size": size},
        lambda t: torch.ops.shardspec.all_to_all(
            t, split_dim=sd, concat_dim=cd, axis=",".join(axes), mesh=key, size=-1 if size is None else size
        ),
        lambda t: _check_tensor("all_to_all", t),
    )


def ppermute(x: Any, *, axis: Axis, perm: Sequence[tuple[int, int]], mesh: Mesh) -> Any:
    """Member ``dst`` gets member ``src``'s tensor for each ``(src, dst)``; members nobody sends to
    get zeros. Positions are along ``axis``."""
    axes = _norm_axes("ppermute", axis, mesh)
    pairs = kernels.check_perm(perm, mesh.axis_size(axes), axes)
    key = ops.mesh_key(mesh)
    flat = [v for pair in pairs for v in pair]
    return _dispatch(
        "ppermute",
        x,
        mesh,
        axes,
        {"perm": pairs},
        lambda t: torch.ops.shardspec.ppermute(t, axis=",".join(axes), perm=flat, mesh=key),
        lambda t: _check_tensor("ppermute", t),
    )


def broadcast(x: Any, *, axis: Axis, src: int, mesh: Mesh) -> Any:
    """Every member gets the tensor of the member at position ``src`` along ``axis``."""
    axes = _norm_axes("broadcast", axis, mesh)
    _check_position("broadcast", "src", src, mesh.axis_size(axes), axes)
    key = ops.mesh_key(mesh)
    return _dispatch(
        "broadcast",
        x,
        mesh,
        axes,
        {"src": src},
        lambda t: torch.ops.shardspec.broadcast(t, axis=",".join(axes), src=src, mesh=key),
        lambda t: _check_tensor("broadcast", t),
    )


def send(x: torch.Tensor, *, axis: Axis, dst: int, mesh: Mesh) -> None:
    """Send this rank's ``x`` to the member at position ``dst`` along ``axis`` (pipeline stages)."""
    axes = _norm_axes("send", axis, mesh)
    _check_position("send", "dst", dst, mesh.axis_size(axes), axes)
    _check_tensor("send", x)
    torch.ops.shardspec.send(x, axis=",".join(axes), dst=dst, mesh=ops.mesh_key(mesh))


def recv(
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    axis: Axis,
    src: int,
    mesh: Mesh,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Receive a ``shape``/``dtype`` tensor from the member at position ``src`` along ``axis``."""
    axes = _norm_axes("recv", axis, mesh)
    _check_position("recv", "src", src, mesh.axis_size(axes), axes)
    _check_tensor("recv", torch.empty(0, dtype=dtype))
    out: torch.Tensor = torch.ops.shardspec.recv(
        shape=list(shape),
        dtype=dtype,
        device=torch.device(device),
        axis=",".join(axes),
        src=src,
        mesh=ops.mesh_key(mesh),
    )
    return out


def wait(x: T) -> T:
    """Complete the async collective that produced ``x`` (a no-op for completed tensors)."""
    if isinstance(x, list):
        return x
    return torch.ops.shardspec.wait(x)  # type: ignore[no-any-return]


def _check_position(kind: str, name: str, value: int, n: int, axes: tuple[str, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise fail(f"{kind}: {name}={value!r} is not a position along {axes} (size {n}).", f"use 0..{n - 1}.")
