"""The sharding compiler: trace -> rules -> propagate -> partition -> runtime.

``sharded`` is the entry point; ``Lowered`` reports a compiled step's program, collectives and costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from compiler.constrain import constrain
from compiler.grad import value_and_grad
from compiler.inductor import check_backend
from compiler.lowered import CollectiveInfo, Cost, Lowered
from compiler.passes import options as pass_options
from compiler.passes.budget import check_budget
from compiler.runtime import ShardedFunction
from shardspec.errors import fail, shown
from shardspec.mesh import Mesh


def sharded(
    fn: Callable[..., Any] | None = None,
    *,
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
    memory_budget: int | None = None,
) -> Any:
    """Compile ``fn`` for ``mesh``: arguments laid out by ``in_specs``, results by ``out_specs``.

    Use as ``@sharded(mesh=..., in_specs=..., out_specs=...)`` or ``sharded(fn, mesh=..., ...)``.
    ``in_specs`` is a tuple with one spec tree per positional argument (a ``P`` covers a whole
    subtree); Python scalars are baked into the program (each new value compiles anew) and take
    ``P()``. The step is compiled once per argument signature (tree, shapes, dtypes, scalar values).

    What an argument means:
      - simulated mesh: a plain tensor is the global value; results are global tensors.
      - real mesh (torchrun): a plain tensor is the *full global value*, identical on every rank
        (each rank slices its block out of it); a DTensor is used as it is laid out (resharded if
        its placements differ from the spec). To pass rank-local data (each rank's own slice of the
        batch, as with DDP), wrap it with ``shardspec.from_local(batch, P("dp"), mesh)``. Results are
        DTensors. Every call checks that all ranks called with the same signature (a rank that never
        calls is reported after ``timeout`` seconds); the first call of each program compares a
        fingerprint of every plain tensor's values across ranks (``check_values=False`` skips it).

    Gradients are taken inside the step (``shardspec.value_and_grad``); the program runs outside
    autograd, so ``torch.func`` transforms and ``loss.backward()`` through it are refused.
    ``unsupported="replicate"`` runs ops without a sharding rule on gathered inputs (with a warning)
    instead of raising. ``strict=True`` raises where two layouts send the same bytes with
    different collectives and nothing in the specs decides (otherwise ``explain()`` notes it).
    A sharded step called inside another one (same mesh) is inlined, its specs acting as
    ``constrain`` on its arguments and results.
    ``passes`` picks the program passes run after partition (``compiler.passes``): None for the
    defaults (views for copies, bucketed, in-place and overlapped collectives), False for none, a
    sequence of pass names, or a mapping of overrides such as ``{"bucket_bytes": 1 << 20}``.
    Memory: ``passes={"regather": False}`` keeps ZeRO-3's forward-gathered parameters until backward
    (fewer bytes, more memory; by default each is gathered again for backward), and
    ``{"zero_bucket_bytes": n}`` sizes the flat buffers of parameter gathers and gradient
    reduce-scatters. ``donate=(0, 1)`` (as ``jax.jit(donate_argnums=...)``) lets the step write its
    results into those arguments' buffers (new parameters and optimizer state over the old, as torch
    optimizers update in place): on a real mesh the returned DTensors share the donated ones' local
    storage; on a simulated mesh shards are copies anyway. After the call a donated argument's
    contents are unspecified, as in JAX: on a real mesh a replicated plain tensor (its block is the
    tensor itself) holds the results, on a simulated mesh it is left as it was; do not read it. A
    donated tensor passed again is an error naming it (use the returned value); donating an argument
    the step returns unchanged is an error.
    ``pipeline=shardspec.Pipeline(axis="pp", schedule="1f1b")`` runs the step as pipeline stages cut
    at its ``shardspec.pipeline_boundary`` calls, one stage (or ``virtual_stages``) per position
    along ``axis``, scheduling ``value_and_grad``'s microbatches (see docs/pipeline.md).
    ``cost_model=shardspec.CostModel(...)`` (the machine: bandwidth and latency per mesh axis, FLOP
    rate) turns on the global planner: every op's sharding chosen for the least modeled step time,
    never worse than greedy propagation (see docs/planner.md); None (default) keeps greedy.
    ``backend="inductor"`` runs each per-rank program's compute through Inductor (``torch.compile``'s
    compiler; C++ code on CPU): the program is cut at its collectives into regions, each compiled
    once per program on the first call (seconds to minutes), the collectives and their schedule
    unchanged; results equal eager up to floating-point rounding (fused loops round differently).
    A region Inductor cannot compile runs eagerly, with a warning. ``"eager"`` (default) runs the
    program op by op (see compiler/inductor.py and docs/benchmarks.md for when Inductor pays).
    ``memory_budget=b`` (bytes per rank) trades memory for bytes under a limit: ZeRO-3's parameters
    are kept gathered from forward to backward (one all-gather fewer each) except the fewest that
    must be gathered again for the predicted peak to stay within ``b``; when no schedule fits, an
    error names the lowest predicted peak and what would lower it.
    """

    if memory_budget is not None:
        if pipeline is not None:
            raise fail(
                f"sharded(memory_budget={shown(memory_budget)}) with pipeline= is not supported: a "
                "pipelined step's stages are scheduled by the pipeline pass, not by the budget.",
                "drop memory_budget for the pipelined step, or run it without pipeline=.",
            )
        passes = replace(pass_options(passes), memory_budget=check_budget(memory_budget))
    pass_options(passes)  # a misspelled option fails here, not at the first call
    check_backend(backend)

    def wrap(f: Callable[..., Any]) -> ShardedFunction:
        return ShardedFunction(
            f,
            mesh,
            in_specs,
            out_specs,
            unsupported,
            strict,
            check_values,
            timeout,
            passes=passes,
            donate=donate,
            pipeline=pipeline,
            cost_model=cost_model,
            backend=backend,
        )

    return wrap(fn) if fn is not None else wrap


__all__ = ["CollectiveInfo", "Cost", "Lowered", "ShardedFunction", "constrain", "sharded", "value_and_grad"]
