"""Stage 7: run a compiled step. Simulated meshes take and return global tensors; real meshes take
DTensors or full tensors and return DTensors. Programs are cached per argument signature."""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable
from typing import Any, cast

import optree
import torch

from collectives.distributed import check_usable, gate, gate_failed, mark_broken, pass_gate, set_wait_timeout
from collectives.simulated import run_simulated
from compiler import constants, donation, inputs
from compiler.constrain import constrain
from compiler.inductor import check_backend, runner
from compiler.lowered import Lowered
from compiler.program import Program, broadcast_specs, compile_program, per_argument
from compiler.random import check_no_outer_rng
from compiler.runtime_real import _constants, _is_dtensor, _real_plan, _RealPlan, _run_real
from compiler.trace import arg_names, path_str
from shardspec.errors import ShardingError, add_note, fail, shown, user_facing
from shardspec.layout import check_spec, shard, unshard
from shardspec.mesh import Mesh
from shardspec.spec import P

# The mesh of the step being traced right now: a sharded step called inside it is inlined.
_TRACING: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("shardspec_tracing", default=None)


def _defined_in_a_class(fn: Any) -> bool:
    """Whether ``fn`` was written in a class body (``Model.forward``), so that ``@sharded`` on it
    makes a method taking ``self``; a function defined elsewhere and stored on a class is not."""
    parts = getattr(fn, "__qualname__", "").split(".")
    return len(parts) > 1 and parts[-2] != "<locals>"


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
        check_values: bool = True,
        timeout: float = 600.0,
        passes: Any = None,
        donate: tuple[int, ...] = (),
        pipeline: Any = None,
        cost_model: Any = None,
        backend: str = "eager",
    ) -> None:
        self.backend = check_backend(backend)
        self.cost_model = cost_model
        self.strict = strict
        self.pipeline = pipeline
        self.donate = donation.donate_argnums(donate)
        self.check_values, self.timeout = check_values, _seconds(timeout)
        self.passes = passes
        if not isinstance(mesh, Mesh):
            raise fail(
                f"sharded(mesh=...) needs a shardspec.Mesh, got {type(mesh).__name__}.",
                "build one with Mesh({'dp': 2}, simulate=True) or under torchrun.",
            )
        from compiler.plan.costmodel import CostModel

        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise fail(
                f"sharded(cost_model=...) needs a shardspec.CostModel, got {type(cost_model).__name__}.",
                "build one: CostModel(bandwidth={'dp': 25e9}, memory_bytes=16 * 2**30), or pass None.",
            )
        if cost_model is not None and isinstance(mesh, Mesh):
            named = sorted(
                {a for a, _ in (*cost_model.bandwidth, *cost_model.latency)} - set(mesh.axis_names)
            )
            if named:
                raise fail(
                    f"sharded(cost_model=...) gives bandwidth or latency for {named}, which "
                    f"{mesh.describe()} does not have.",
                    f"name the mesh's axes {list(mesh.axis_names)}.",
                )
        if unsupported not in ("error", "replicate"):
            raise fail(
                f"sharded(unsupported={shown(unsupported)}) is not an option.",
                "use 'error' (default) or 'replicate'.",
            )
        self.fn, self.mesh, self.in_specs, self.out_specs = fn, mesh, in_specs, out_specs
        self.unsupported = unsupported
        self._cache: dict[Any, Program] = {}
        self._constants: dict[int, constants.Snapshot] = {}  # per program: its closed-over tensors
        self._owner: Any = None  # a method's self
        self._modules: constants.Modules | None = None  # nn.Modules it reaches: train/eval in the key
        self._plans: dict[int, _RealPlan] = {}  # per program: per-call metadata and its digest
        self._values_checked: set[tuple[int, tuple[bool, ...]]] = set()
        self._small: dict[tuple[int, tuple[bool, ...]], tuple[int, ...]] = {}  # per program and call kind
        code = getattr(fn, "__code__", None)
        where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
        # which step this is, the same on every rank (two lambdas differ by their line)
        self._identity = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}@{where}"
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "step")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """``@sharded`` on a method: the step of ``obj``'s bound method (its attributes are closed
        over, as constants), kept in the instance's ``__dict__`` so each instance compiles once
        and is freed with it (as ``functools.cached_property`` keeps its values)."""
        if obj is None or not _defined_in_a_class(self.fn):
            return self  # a step kept as a class attribute (step = sharded(train_step, ...))
        slot = f"_shardspec_step_{self.__name__}_{id(self):x}"
        held = getattr(obj, "__dict__", None)
        bound = held.get(slot) if held is not None else None
        if bound is None:
            bound = ShardedFunction(
                types.MethodType(self.fn, obj),
                self.mesh,
                self.in_specs,
                self.out_specs,
                self.unsupported,
                self.strict,
                self.check_values,
                self.timeout,
                self.passes,
                self.donate,
                self.pipeline,
                self.cost_model,
                self.backend,
            )
            bound._identity = self._identity  # the method's own line, on every rank
            bound._owner = obj  # (held by the bound method anyway)
            if held is not None:
                held[slot] = bound
        return bound

    def _program(self, args: tuple[Any, ...]) -> tuple[Program, tuple[Any, ...]]:
        if self.mesh.simulated:
            inputs.check_not_dtensor(self.fn, args, self.mesh)
        if self._modules is None or self._modules.moved():  # walked again only when a place moved
            self._modules = constants.modules(self.fn, self._owner)
        key = (*inputs.signature(self.fn, args), tuple(m.training for m in self._modules.all))
        if key not in self._cache:
            if len(self._cache) == RECOMPILE_WARNING - 1:
                self._warn_recompiles(key, args)
            device = None if self.mesh.simulated else self.mesh.device_mesh.device_type
            globals_ = tuple(_global_view(a, device) for a in args)
            before = constants.values(self.fn, self._owner)
            token = _TRACING.set(self.mesh)
            try:
                program = compile_program(
                    self.fn,
                    globals_,
                    self.mesh,
                    self.in_specs,
                    self.out_specs,
                    self.unsupported,
                    self.strict,
                    passes=self.passes,
                    donate=self.donate,
                    pipeline=self.pipeline,
                    cost_model=self.cost_model,
                    held_buckets=not self.mesh.simulated and self.backend == "eager",
                )
            finally:
                _TRACING.reset(token)
            # what it closes over, as compiled (lower() included); cached only once that is known
            self._constants[id(program)] = constants.snapshot(
                _constants(program), self.fn, self._owner, before
            )
            self._cache[key] = program
        return self._cache[key], key

    def _warn_recompiles(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> None:
        """A step compiled again and again is almost always a Python number that changes every
        call (a learning-rate schedule): name the leaves that made this call's key new."""
        import warnings

        first = next(iter(self._cache))
        paths = optree.tree_paths(cast(Any, args), none_is_leaf=False)
        names = arg_names(self.fn, len(args))
        changed = [
            path_str(names[p[0]], p[1:])
            for p, a, b in zip(paths, key[1], first[1], strict=False)
            if a != b and a[0] != "Tensor"
        ]
        why = (
            f"the Python values of {', '.join(changed[:5])} differ from the first call's. Pass a "
            "number that changes between calls as a 0-dim tensor (torch.tensor(lr)) to compile once."
            if changed
            else "its arguments' shapes, dtypes or tree structure differ from the first call's. Keep "
            "them fixed (e.g. pad the last batch), since each new signature compiles a program."
        )
        warnings.warn(
            f"shardspec: {self.__name__} is compiling its {RECOMPILE_WARNING}th program (one per "
            f"argument signature; Python numbers are compiled in as constants): {why}",
            stacklevel=4,
        )

    @user_facing
    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        self._positional(args, kwargs, ".lower")
        if _TRACING.get() is None:
            check_no_outer_rng(self.__name__ + ".lower")
        return Lowered(self._program(args)[0])

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any], method: str = "") -> None:
        if kwargs:
            names = arg_names(self.fn, len(args) + len(kwargs))
            raise fail(
                f"{self.__name__}{method}(...) was called with keyword arguments ({', '.join(kwargs)}); a "
                "sharded step takes its arguments by position, as its in_specs do.",
                f"pass them positionally: {self.__name__}{method}({', '.join(names)}).",
            )

    @user_facing
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._positional(args, kwargs)
        outer = _TRACING.get()
        if outer is not None:
            return self._inline(outer, args)
        check_no_outer_rng(self.__name__)
        leaves: list[Any] = optree.tree_leaves(cast(Any, args), none_is_leaf=False)
        if donation.suspect(leaves):  # the checks below name the argument's path: run them only then
            inputs.check_autograd(self.fn, args)
            donation.check_not_donated(args, self.fn)
        if any(i >= len(args) for i in self.donate):
            raise fail(
                f"sharded(donate={self.donate}) names argument {max(self.donate)} but "
                f"{self.__name__} was called with {len(args)}.",
                "donate positions of the step's own positional arguments.",
            )
        try:
            program, key = self._program(args)
            constants.check_unchanged(self._constants[id(program)], self.__name__)
        except Exception:
            self._tell_other_ranks_this_one_failed()
            raise
        tensors = [leaves[i] for i in program.traced.tensor_positions]
        if program.donated:
            donation.check_donated_alone(tensors, program)
        for i in program.donated:  # after this call their storage may hold its results
            donation.mark_donated(tensors[i], program.traced.in_paths[i], self.__name__)
        if self.mesh.simulated:
            outs = _run_simulated(program, tensors, self.backend)
        else:
            plan = self._plans.get(id(program))
            if plan is None:
                plan = self._plans[id(program)] = _real_plan(program)
            plain = tuple(not _is_dtensor(t) for t in tensors)
            if self.mesh.size > 1:  # (one rank agrees with itself)
                check_usable(self.__name__)
                # which arguments are DTensors, and their placements, are part of the call: a rank
                # passing a plain tensor where another passes a DTensor takes another path. Completed
                # before the program's first collective (the gate), so its round trip overlaps the
                # compute that precedes it, if any (it must complete before any collective is issued:
                # a rank whose program differs would pair its collectives with the wrong ones)
                layouts = tuple(
                    None if p else t._spec.placements for p, t in zip(plain, tensors, strict=True)
                )
                # a small plain CPU tensor is often a value that changes between calls (a learning
                # rate passed as a 0-dim tensor to avoid recompiling): after the first call's check
                # of every value (below), its value is checked on every call
                checked = (id(program), plain) in self._values_checked
                small = self._small.get((id(program), plain)) if checked else ()
                if small is None:
                    small = self._small[(id(program), plain)] = inputs.small_positions(tensors, plain)
                call = inputs.start_same_call(
                    (key, layouts),
                    self._identity,
                    plan.digest,
                    self.__name__,
                    self.timeout,
                    inputs.small_values(tensors, small),
                    lambda: inputs.describe_call(self.fn, args, key[2:]),
                )
                gate(call)
            if self.check_values and (id(program), plain) not in self._values_checked:
                pass_gate()
                closed = _constants(program)
                inputs.check_same_values(
                    tensors + [c for _, c in closed],
                    program.traced.in_paths + tuple(name for name, _ in closed),
                    self.__name__,
                    self.timeout,
                )
                self._values_checked.add((id(program), plain))
            set_wait_timeout(self.timeout if self.mesh.device_mesh.device_type == "cpu" else None)
            try:
                outs = _run_real(program, plan, tensors, self.backend)
            except BaseException as exc:
                # our own checks (ShardingError) fail alike on every rank, before any collective
                # (a collective that timed out marks the group itself); anything else (a kernel's
                # error on this rank's data, an interrupt) may leave peers waiting in a collective,
                # unless the call's agreement check, still held, finds the ranks called differently
                if self.mesh.size > 1 and not isinstance(exc, ShardingError) and _calls_agreed():
                    _broken(self.__name__, exc)
                raise
            finally:  # a program with no collective, or one that raised before its first
                try:
                    pass_gate()
                finally:  # collectives called outside a step wait as c10d does
                    set_wait_timeout(None)
        return optree.tree_unflatten(program.traced.out_tree, outs)

    def _tell_other_ranks_this_one_failed(self) -> None:
        """A rank whose compile raised (a spec or argument only it has wrong) still takes part in the
        call's rank-agreement exchange, as a call that differs: the others then fail at once with
        "called with different arguments" instead of waiting out the timeout for it. Its own error
        is the one it raises (where every rank failed alike, none differs and each raises its own)."""
        if self.mesh.simulated or self.mesh.size == 1 or _TRACING.get() is not None:
            return
        with contextlib.suppress(Exception):  # the others differ (they called as usual), or never came
            inputs.start_same_call(
                ("this rank could not compile the call",),
                self._identity,
                inputs.FAILED,
                self.__name__,
                self.timeout,
            )()

    def _inline(self, outer: Mesh, args: tuple[Any, ...]) -> Any:
        """A sharded step called while another is traced: its specs become constraints, like nested jit."""
        if outer != self.mesh:
            raise fail(
                f"{self.__name__} (mesh {self.mesh.describe()}) is called inside a sharded step on "
                f"another mesh, {outer.describe()}; a step runs on one mesh.",
                f"build {self.__name__} on the outer step's mesh, or call the plain function inside.",
            )
        names = arg_names(self.fn, len(args))
        in_specs = per_argument(self.in_specs, args, names, f"{self.__name__} (called inside another step)")
        specs = broadcast_specs(in_specs, args, "in_specs", names)
        paths, leaves, tree = optree.tree_flatten_with_path(cast(Any, args), none_is_leaf=False)
        for path, x, s in zip(paths, leaves, specs, strict=True):  # named as this step's, not a constrain
            if isinstance(x, torch.Tensor) and isinstance(s, P):
                check_spec(
                    tuple(x.shape),
                    self.mesh,
                    s,
                    name=f"{self.__name__}: {path_str(names[path[0]], path[1:])}",
                )
        pinned = [
            constrain(x, s) if isinstance(x, torch.Tensor) else x for x, s in zip(leaves, specs, strict=True)
        ]
        result = self.fn(*optree.tree_unflatten(tree, pinned))
        out_specs = broadcast_specs(self.out_specs, result, "out_specs")
        out_leaves, out_tree = optree.tree_flatten(result, none_is_leaf=False)
        return optree.tree_unflatten(
            out_tree,
            [
                constrain(x, s) if isinstance(x, torch.Tensor) else x
                for x, s in zip(out_leaves, out_specs, strict=True)
            ],
        )


FOREVER = 2.0**31  # seconds: timeout=None or inf (a finite deadline c10d can convert)


def _calls_agreed() -> bool:
    """Complete the call's agreement check if it is still held: False when it fails (the ranks
    called differently: every rank raises it, and none is left waiting in the program)."""
    try:
        pass_gate()
    except ShardingError:
        return False
    return not gate_failed()


def _broken(step: str, exc: BaseException) -> None:
    """A step that raised on this rank partway through its program leaves peers that may wait in
    one of its collectives: the group takes no more (``check_usable``), and the error says so."""
    mark_broken(f"an earlier call of {step} raised on this rank inside its program ({type(exc).__name__}).")
    if not isinstance(exc, KeyboardInterrupt):
        add_note(
            exc,
            f"shardspec: {step} raised on this rank partway through its program; its peers may "
            "still wait in one of its collectives, so this process group can run no further "
            "collective (a later call is an error). End the job; torchrun restarts it.",
        )


def _seconds(timeout: Any) -> float:
    """``sharded(timeout=...)`` as seconds: a positive number, or None / inf for no deadline."""
    try:
        seconds = FOREVER if timeout is None else float(timeout)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(timeout, (bool, str)) or not seconds > 0:
        raise fail(
            f"sharded(timeout={shown(timeout)}) is not a positive number of seconds.",
            "pass how long a rank may wait for the others, e.g. timeout=600 (the default), or None.",
        )
    return min(seconds, FOREVER)


RECOMPILE_WARNING = 8  # programs of one step after which a warning names the changing scalars


def _global_view(arg: Any, device: str | None = None) -> Any:
    """Arguments as traced: DTensors become fake-free stand-ins of their global shape, and on a
    real mesh a plain tensor on another device than the mesh's a stand-in on the mesh's device,
    where the runtime moves it (so the trace picks that device's kernels, e.g. attention)."""
    from torch.distributed.tensor import DTensor

    def conv(x: Any) -> Any:
        if isinstance(x, DTensor):
            return torch.empty(x.shape, dtype=x.dtype, device=x.to_local().device)
        if device is not None and isinstance(x, torch.Tensor) and x.device.type != device:
            return torch.empty_like(x, device=device)
        return x

    return optree.tree_map(conv, arg, none_is_leaf=False)


def _run_simulated(
    program: Program, tensors: list[torch.Tensor], backend: str = "eager"
) -> list[torch.Tensor]:
    mesh = program.mesh
    pieces = [
        shard(t, mesh, s, name=p)
        for t, s, p in zip(tensors, program.in_specs, program.traced.in_paths, strict=True)
    ]
    pp = program.pipeline
    empty = torch.empty(0)

    def body(rank: int) -> list[torch.Tensor]:
        if pp is None:
            args = [p[rank] for p in pieces]
        else:  # a pipeline position holds only the inputs its stages read
            reads = pp.per_rank[rank].reads
            args = [p[rank] if i in reads else empty for i, p in enumerate(pieces)]
        with torch.no_grad():
            return list(runner(program.programs[rank], backend)(*args))

    per_rank = run_simulated(body, mesh)
    if pp is not None:  # each result comes from the ranks of the position that computed it
        axis = pp.pipeline.axis
        owners = pp.per_rank[0].outputs
        per_rank = [
            [
                per_rank[mesh.rank_of({**mesh.coords(r), axis: owners[i]})][i]
                for i in range(len(program.out_specs))
            ]
            for r in range(mesh.size)
        ]
    return [
        unshard([per_rank[r][i] for r in range(mesh.size)], mesh, spec, name=path)
        for i, (spec, path) in enumerate(zip(program.out_specs, program.traced.out_paths, strict=True))
    ]
