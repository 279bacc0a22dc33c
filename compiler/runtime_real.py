"""The real-mesh half of the runtime: per program, the placements, slices and result specs computed
once (``_RealPlan``) and the digest every rank must share; per call, this rank's blocks of the
arguments in, the per-rank program run, DTensors out."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from collectives.distributed import pass_gate
from compiler import inputs
from compiler.backend import ResultWrapper, dtensor_type
from compiler.inductor import runner
from compiler.passes.fast_calls import fast_calls
from compiler.passes.fast_gelu import fast_gelu
from compiler.passes.held import hold_buckets
from compiler.pipeline.real import stage_input, stage_results
from compiler.program import Program
from shardspec.layout import device_slices
from shardspec.placements import spec_to_placements


@dataclass(frozen=True)
class _RealPlan:
    """What a real call needs besides the program, computed once per program (not per call)."""

    in_placements: tuple[tuple[Any, ...], ...]
    in_slices: tuple[tuple[slice, ...], ...]  # this rank's block of each full-tensor argument
    out_placements: tuple[list[Any], ...]
    out_shapes: tuple[torch.Size, ...]
    out_strides: tuple[tuple[int, ...], ...]
    digest: int  # of the input shapes and the collective sequence: ranks compare it every call
    wrap: ResultWrapper  # the results' DTensor specs, built on the first call
    shared: _Shared  # results that may share storage with an argument, a constant or each other
    held: Any  # this rank's program with its all-reduce buckets held between calls (eager backend)
    run: Any  # ``held`` as the eager backend calls it (``fast_gelu``, ``fast_calls``; same buffers)


def _real_plan(program: Program) -> _RealPlan:
    mesh, traced = program.mesh, program.traced
    ins = list(zip(traced.inputs, program.in_specs, traced.in_paths, strict=True))
    outs = list(zip(traced.outputs, program.out_specs, traced.out_paths, strict=True))
    return _RealPlan(
        tuple(spec_to_placements(s, mesh, t.shape, name=p) for t, s, p in ins),
        tuple(device_slices(t.shape, mesh, s, mesh.rank) for t, s, _ in ins),
        tuple(list(spec_to_placements(s, mesh, t.shape, name=p)) for t, s, p in outs),
        tuple(torch.Size(t.shape) for t, _, _ in outs),
        tuple(torch.empty(t.shape, device="meta").stride() for t, _, _ in outs),
        _program_digest(program, mesh.rank),
        ResultWrapper(
            mesh.device_mesh,
            [list(spec_to_placements(s, mesh, t.shape, name=p)) for t, s, p in outs],
            [torch.Size(t.shape) for t, _, _ in outs],
            [torch.empty(t.shape, device="meta").stride() for t, _, _ in outs],
        ),
        _aliased_results(program),
        held := hold_buckets(program.programs[mesh.rank]),
        _eager_calls(held, *program.eager_calls),
    )


def _eager_calls(held: Any, calls: bool, gelu: bool) -> Any:
    """``held`` with the eager runtime's faster calls the pass options chose (``fast_calls``,
    ``fast_gelu``); none where the program ran no passes."""
    gm = fast_gelu(held) if gelu else held
    return fast_calls(gm) if calls else gm


@dataclass(frozen=True)
class _Shared:
    """The results of a program that may share storage with a caller's (not donated) argument, a
    constant, or another result, by its ops' alias annotations (see ``_aliased_results``)."""

    candidates: tuple[int, ...]  # results that may share storage
    owned: tuple[int, ...]  # the caller's arguments they may share it with
    constants: tuple[int, ...]  # results that are (views of) a tensor the step closes over

    def unshare(self, outs: list[Any], args: list[torch.Tensor]) -> None:
        """Copy each candidate that shares storage with a caller's argument or a constant, or
        overlaps the bytes of an earlier result."""
        callers = {args[i].untyped_storage().data_ptr() for i in self.owned}
        spans: list[tuple[int, int, int]] = []
        for k in self.candidates:
            t = outs[k]
            storage, start = t.untyped_storage().data_ptr(), t.data_ptr()
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
            end = start + extent * t.element_size() if t.numel() else start
            overlaps = any(s == storage and lo < end and start < hi for s, lo, hi in spans)
            if storage in callers or k in self.constants or overlaps:
                outs[k] = t.clone()
            else:
                spans.append((storage, start, end))


def _aliased_results(program: Program) -> _Shared:
    """Which results the call copies, as a simulated mesh returns copies: a later donation of one
    result, or the caller changing its own tensor, must not reach another tensor (``place =
    sharded(lambda p: p)`` followed by a donating step would overwrite the caller's parameters)."""
    from compiler.passes.graph import aliases_input

    def root(n: Any) -> Any:
        while n.op == "call_function" and n.all_input_nodes and aliases_input(n):
            n = n.all_input_nodes[0]
        return n

    nodes = list(program.programs[program.mesh.rank].graph.nodes)
    holders = [n for n in nodes if n.op == "placeholder"]
    donated = {holders[i] for i in program.donated if i < len(holders)}
    roots = [root(a) if isinstance(a, torch.fx.Node) else None for a in nodes[-1].args[0]]
    shared = {r for r in roots if r is not None and roots.count(r) > 1}
    caller = {r for r in roots if r is not None and r.op == "placeholder" and r not in donated}
    constant = {r for r in roots if r is not None and r.op == "get_attr"}
    return _Shared(
        tuple(k for k, r in enumerate(roots) if r in shared or r in caller or r in constant),
        tuple(sorted(holders.index(r) for r in caller)),
        tuple(k for k, r in enumerate(roots) if r in constant),
    )


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, dtensor_type())


def _constants(program: Program) -> list[tuple[str, torch.Tensor]]:
    """Tensors the step closes over (graph constants): they too must be equal on every rank."""
    from compiler.sources import source_of

    module = program.traced.module
    return [
        (
            f"a tensor the step closes over (used at {source_of(n) or n.target})",
            getattr(module, str(n.target)),
        )
        for n in module.graph.nodes
        if n.op == "get_attr" and isinstance(getattr(module, str(n.target), None), torch.Tensor)
    ]


def _run_real(program: Program, plan: _RealPlan, tensors: list[Any], backend: str = "eager") -> list[Any]:
    from torch.distributed.tensor import DTensor

    mesh = program.mesh
    pp = program.pipeline
    device = mesh.device_mesh.device_type
    reads = pp.per_rank[mesh.rank].reads if pp is not None else None
    if pp is not None:
        pass_gate()  # a stage's inputs may move between sub-meshes first (DTensor collectives)
    local = []
    for i, (t, path, want, where) in enumerate(
        zip(tensors, program.traced.in_paths, plan.in_placements, plan.in_slices, strict=True)
    ):
        if (
            pp is not None
            and isinstance(t, DTensor)
            and (block := stage_input(t, program, i, want, path)) is not None
        ):
            local.append(block)  # a DTensor on a stage's sub-mesh, as the step returned it
        elif isinstance(t, DTensor):  # checked and moved on every rank alike, read or not
            if t._spec.mesh is not mesh.device_mesh:
                inputs.check_dtensor_mesh(t, mesh, path)
            if t._spec.placements != want:
                pass_gate()  # DTensor's own collectives: only once every rank agreed on the call
                t = t.redistribute(mesh.device_mesh, list(want))
            held = reads is None or i in reads  # else another pipeline stage's value
            # the local block itself: to_local()'s autograd Function (~13 µs a call, ~160 calls a
            # GPT step) only matters for gradients, and a step's arguments never require grad
            # dense, as the program was compiled for (a no-op for the usual dense block)
            local.append(t._local_tensor.contiguous() if held else torch.empty(0, dtype=t.dtype))
        elif reads is not None and i not in reads:  # another pipeline stage's value: not held here
            local.append(torch.empty(0, dtype=t.dtype))
        else:
            local.append(_block(t, where, device, own=i in program.donated))
    with torch.no_grad():
        outs = list(
            plan.run(*local) if backend == "eager" else runner(program.programs[mesh.rank], backend)(*local)
        )
        if plan.shared.candidates:
            plan.shared.unshare(outs, local)
    if pp is not None:
        from collectives.distributed import wait_sends

        wait_sends()
        return stage_results(program, outs, plan.out_placements, plan.out_shapes, plan.out_strides)
    return plan.wrap(outs)


def _block(t: torch.Tensor, where: Any, device: str, own: bool) -> torch.Tensor:
    """This rank's block of a plain (global) argument. A donated one gets storage of its own size:
    the results written into it are returned, and a slice of ``t`` would keep all of ``t``'s
    storage alive through them, N times the block under an N-way split. Other blocks may stay views
    (a batch sliced every step is not copied)."""
    block = t[where].to(device)  # NCCL takes GPU tensors only
    if own and block.untyped_storage().nbytes() > block.numel() * block.element_size():
        return block.clone(memory_format=torch.contiguous_format)
    return block.contiguous()


def _program_digest(program: Program, rank: int) -> int:
    """A hash of what every rank must share: the input shapes, the specs, the traced step (its ops
    and the Python values baked into them, e.g. a learning rate a closure captured) and the
    collective sequence of this rank's program (of every rank's, for a pipeline, whose positions
    run different programs). Two steps wrapping one function with other constants or specs have the
    same name and line: only their programs tell them apart."""
    ranks = range(program.mesh.size) if program.pipeline is not None else [rank]
    calls = [
        n
        for r in ranks
        for n in program.programs[r].graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", "") == "shardspec"
    ]
    text = "\n".join(
        [
            repr([(i.shape, i.dtype) for i in program.traced.inputs]),
            repr((program.in_specs, program.out_specs, program.eager_calls)),
            _graph_text(program.traced.module.graph),
            *(f"{n.target} {sorted((k, v) for k, v in n.kwargs.items() if k != 'size')}" for n in calls),
        ]
    )
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def _graph_text(graph: torch.fx.Graph) -> str:
    """The graph's ops and arguments, the same text in every process: nodes by name, Python values
    by repr, any other object by its type (its repr may hold a memory address)."""

    def plain(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            return type(a)(plain(x) for x in a)
        if isinstance(a, dict):
            return {k: plain(v) for k, v in a.items()}
        if isinstance(a, torch.device):
            return a.type  # each rank's own GPU (cuda:<local rank>) is the same device to agree on
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.layout)):
            return a
        return type(a).__name__

    def name(t: Any) -> str:
        if isinstance(t, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return str(t)
        return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', type(t).__name__)}"

    return "\n".join(f"{n.op} {name(n.target)} {plain(n.args)} {plain(n.kwargs)}" for n in graph.nodes)
