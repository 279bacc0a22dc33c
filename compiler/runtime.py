"""Stage 7: run a compiled step. Simulated meshes take and return global tensors; real meshes take
DTensors or full tensors and return DTensors. Programs are cached per argument signature."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, cast

import optree
import torch

from collectives.simulated import run_simulated
from compiler.lowered import Lowered
from compiler.program import Program, compile_program
from shardspec.errors import fail
from shardspec.layout import device_slices, shard, unshard
from shardspec.mesh import Mesh
from shardspec.placements import spec_to_placements


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    leaves, tree = optree.tree_flatten(cast(Any, args), none_is_leaf=False)
    sig = tuple(
        (type(x).__name__, tuple(x.shape), x.dtype, str(x.device))
        if isinstance(x, torch.Tensor)
        else (type(x).__name__, x)
        for x in leaves
    )
    return (tree, sig)


class ShardedFunction:
    """A step compiled for a mesh and specs: call it like the function; ``lower`` shows the plan."""

    def __init__(
        self,
        fn: Callable[..., Any],
        mesh: Mesh,
        in_specs: Any,
        out_specs: Any,
        unsupported: str = "error",
        strict: bool = False,
    ) -> None:
        self.strict = strict
        if not isinstance(mesh, Mesh):
            raise fail(
                f"sharded(mesh=...) needs a shardspec.Mesh, got {type(mesh).__name__}.",
                "build one with Mesh({'dp': 2}, simulate=True) or under torchrun.",
            )
        if unsupported not in ("error", "replicate"):
            raise fail(
                f"sharded(unsupported={unsupported!r}) is not an option.",
                "use 'error' (default) or 'replicate'.",
            )
        self.fn, self.mesh, self.in_specs, self.out_specs = fn, mesh, in_specs, out_specs
        self.unsupported = unsupported
        self._cache: dict[Any, Program] = {}
        self._checked: set[Any] = set()
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "step")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _program(self, args: tuple[Any, ...]) -> Program:
        globals_ = tuple(_global_view(a) for a in args)
        key = _signature(globals_)
        if key not in self._cache:
            self._cache[key] = compile_program(
                self.fn, globals_, self.mesh, self.in_specs, self.out_specs, self.unsupported, self.strict
            )
        return self._cache[key]

    def lower(self, *args: Any) -> Lowered:
        return Lowered(self._program(args))

    def __call__(self, *args: Any) -> Any:
        program = self._program(args)
        leaves: list[Any] = optree.tree_leaves(cast(Any, args), none_is_leaf=False)
        tensors = [leaves[i] for i in program.traced.tensor_positions]
        if self.mesh.simulated:
            outs = _run_simulated(program, tensors)
        else:
            outs = _run_real(program, tensors, self._checked)
        return optree.tree_unflatten(program.traced.out_tree, outs)


def _global_view(arg: Any) -> Any:
    """Arguments as traced: DTensors become fake-free stand-ins of their global shape."""
    from torch.distributed.tensor import DTensor

    def conv(x: Any) -> Any:
        if isinstance(x, DTensor):
            return torch.empty(x.shape, dtype=x.dtype, device=x.to_local().device)
        return x

    return optree.tree_map(conv, arg, none_is_leaf=False)


def _run_simulated(program: Program, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    mesh = program.mesh
    pieces = [
        shard(t, mesh, s, name=p)
        for t, s, p in zip(tensors, program.in_specs, program.traced.in_paths, strict=True)
    ]

    def body(rank: int) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(program.programs[rank](*[p[rank] for p in pieces]))

    per_rank = run_simulated(body, mesh)
    return [
        unshard([per_rank[r][i] for r in range(mesh.size)], mesh, spec, name=path)
        for i, (spec, path) in enumerate(zip(program.out_specs, program.traced.out_paths, strict=True))
    ]


def _run_real(program: Program, tensors: list[Any], checked: set[Any]) -> list[Any]:
    from torch.distributed.tensor import DTensor

    mesh = program.mesh
    rank = mesh.rank
    local = []
    for t, spec, path in zip(tensors, program.in_specs, program.traced.in_paths, strict=True):
        if isinstance(t, DTensor):
            want = list(spec_to_placements(spec, mesh, tuple(t.shape), name=path))
            if list(t.placements) != want:
                t = t.redistribute(mesh.device_mesh, want)
            local.append(t.to_local())
        else:
            local.append(t[device_slices(tuple(t.shape), mesh, spec, rank)].contiguous())
    if id(program) not in checked:
        _check_same_program(program, rank)
        checked.add(id(program))
    with torch.no_grad():
        outs = list(program.programs[rank](*local))
    results = []
    for out, spec, info, path in zip(
        outs, program.out_specs, program.traced.outputs, program.traced.out_paths, strict=True
    ):
        placements = spec_to_placements(spec, mesh, info.shape, name=path)
        stride = torch.empty(info.shape, device="meta").stride()
        results.append(
            DTensor.from_local(
                out,
                mesh.device_mesh,
                list(placements),
                run_check=False,
                shape=torch.Size(info.shape),
                stride=stride,
            )
        )
    return results


def _check_same_program(program: Program, rank: int) -> None:
    """Every rank must run the same collective sequence: compare hashes instead of hanging."""
    import torch.distributed as dist

    calls = [
        n
        for n in program.programs[rank].graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", "") == "shardspec"
    ]
    text = repr([(i.shape, i.dtype) for i in program.traced.inputs]) + "\n".join(
        f"{n.target} {sorted((k, v) for k, v in n.kwargs.items() if k != 'size')}" for n in calls
    )
    digest = int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
    mine = torch.tensor([digest], dtype=torch.int64)
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    hashes = [int(t.item()) for t in everyone]
    if len(set(hashes)) > 1:
        groups: dict[int, list[int]] = {}
        for r, h in enumerate(hashes):
            groups.setdefault(h, []).append(r)
        raise fail(
            f"ranks compiled different programs (collective sequences differ): rank groups "
            f"{list(groups.values())}. Running would hang or compute wrong results.",
            "make the step and its arguments' shapes, dtypes and Python values identical on "
            "every rank (no rank-dependent branches or shapes).",
        )
