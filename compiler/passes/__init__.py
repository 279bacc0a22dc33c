"""Passes over the per-rank program, run after partition: each a pure function program -> program.

| pass        | what it does                                                                 | default |
|-------------|------------------------------------------------------------------------------|---------|
| ``views``   | functionalization's ``*_copy`` ops become views (``view_copy`` -> reshape);    | on      |
|             | layer norm's weight/bias gradient sums go back into its kernel (``norm_grads``)|         |
| ``remat``   | a ``shardspec.remat`` region's values backward reads are recomputed there      | on      |
| ``regather``| a parameter gathered for forward and backward is gathered again for backward   | on      |
| ``cast``    | a narrowing cast after a gather moves before it; gradient ``reduce_dtype``     | on      |
| ``bucket``  | same-kind collectives merged into flat-buffer launches of ``bucket_bytes``     | on      |
| ``inplace`` | an all-reduce of a buffer nothing else reads reduces it in place               | on      |
| ``overlap`` | async issue as soon as the input is ready, wait at the first use               | on      |

``sharded(..., passes=...)`` picks them: ``None`` for the defaults, ``False`` or ``()`` for none, a
sequence of names for exactly those, or a mapping of overrides (``{"overlap": False,
"bucket_bytes": 1 << 20}``). ``regather`` is ZeRO-3's memory-for-bytes trade: with it each gathered
parameter is held only around the layer using it, for one more all-gather of it per step
(``{"regather": False}`` keeps the forward copy until backward instead); with it, a local slice
of a whole value (a gradient computed whole, sliced for the optimizer) runs as soon as the value
exists (``slice_early``), so the whole value is not held to the end of the step. ``zero_bucket_bytes``
caps the buckets of parameter gathers and gradient reduce-scatters, which hold their tensors
unsharded (default: a phase's in about 8 launches, 1 MiB to ``bucket_bytes`` each).

Memory: with ``bucket``, each gradient is copied into its bucket's flat buffer as soon as it is
computed (``pack_early``; ``{"pack_early": False}`` packs the bucket when its last member is
ready). On a real mesh's eager runtime, where DP's all-reduce buckets are held between calls
(``held.py``), values that die before part of a bucket is written are computed into it
(``colocate``; off with ``pack_early``), and the other large intermediates get fixed offsets in one
buffer held between calls (``arena``; ``{"arena": False}`` turns it off). ``memory_budget`` (bytes per rank;
``sharded(memory_budget=...)`` sets it) makes ``regather`` a choice per parameter: the fewest
parameters gathered again for backward that keep the predicted peak within the budget, or an error
when no schedule fits (``passes/budget.py``).

The eager runtime on a real mesh also calls tensor methods where the program has view, slice and
matmul overloads (``fast_calls``: the same bits, a third of the Python per call) and computes CPU
tanh-GELU as ``x * sigmoid(2y)`` (``fast_gelu``: faster and more accurate, but not ATen's bits;
``{"fast_gelu": False}`` keeps ATen's kernel). Neither runs where every pass is off.

Uneven layouts give ranks different programs; bucket sizes could then differ between ranks, so
where the ranks' collective sequences would differ, bucketing is skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch.fx import GraphModule

from collectives.ops import fake_rank
from compiler.passes.arena import arena_
from compiler.passes.bucketing import bucketing, bucketing_
from compiler.passes.budget import check_budget, fewest_regathers
from compiler.passes.cast import cast, cast_
from compiler.passes.colocate import colocate_
from compiler.passes.donate import donate_
from compiler.passes.graph import LAUNCHES, annotate, copy_module
from compiler.passes.inplace import inplace, inplace_
from compiler.passes.liveness import peak as live_peak
from compiler.passes.norm_grads import norm_grads_
from compiler.passes.overlap import overlap, overlap_
from compiler.passes.pack_early import pack_early, pack_early_
from compiler.passes.regather import candidates, mark_backward, regather, regather_
from compiler.passes.remat import Regions, remat, remat_
from compiler.passes.slice_early import slice_early, slice_early_
from compiler.passes.views import dense_kernel_inputs_, dense_results, dense_results_, views, views_
from shardspec.errors import fail, shown

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb
NAMES = ("views", "remat", "regather", "cast", "bucket", "inplace", "overlap")
SWITCHES = ("pack_early", "arena", "fast_calls", "fast_gelu")  # on by default, set by mapping only


@dataclass(frozen=True)
class PassOptions:
    views: bool = True
    remat: bool = True
    regather: bool = True
    cast: bool = True
    bucket: bool = True
    inplace: bool = True
    overlap: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    zero_bucket_bytes: int | None = None
    reduce_dtype: torch.dtype | None = None  # gradient reductions in this dtype (None: as computed)
    pack_early: bool = True  # a gradient copied into its bucket as soon as computed (with bucket)
    arena: bool = True  # large intermediates at planned offsets of a buffer held between calls
    memory_budget: int | None = None  # peak bytes per rank: regather chosen per parameter to fit
    fast_calls: bool = True  # eager real mesh: tensor methods for view/matmul overloads (same bits)
    fast_gelu: bool = True  # eager real mesh, CPU: tanh-GELU as x*sigmoid(2y) (not ATen's bits)


def options(spec: Any) -> PassOptions:
    """``sharded(passes=...)`` -> PassOptions (see the module doc)."""
    if spec is None or spec is True:
        return PassOptions()
    if isinstance(spec, PassOptions):
        return spec
    if spec is False:
        spec = ()
    if isinstance(spec, Mapping):
        unknown = set(spec) - {f.name for f in fields(PassOptions)}
        dtype = spec.get("reduce_dtype")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise fail(
                f"sharded(passes={{'reduce_dtype': {shown(dtype)}}}) is not a floating dtype.",
                "use torch.bfloat16 (half the bytes), torch.float32 (sums without bf16 rounding), "
                "or None (each gradient reduced where its sum is placed, in that value's dtype: after an "
                "upcast for the update, in fp32).",
            )
        if "memory_budget" in spec:
            check_budget(spec["memory_budget"])
        for key in (*NAMES, *SWITCHES):
            switch = spec.get(key, True)
            if type(switch).__name__ not in ("bool", "bool_"):  # numpy's bool too
                raise fail(
                    f"sharded(passes={{{key!r}: {shown(switch)}}}) is not True or False.",
                    f"pass {key!r}: True or False (a string such as 'False' counts as true).",
                )
        sizes = {}
        for key in ("bucket_bytes", "zero_bucket_bytes"):
            size = spec.get(key)
            if key not in spec or (size is None and key == "zero_bucket_bytes"):
                continue
            if _byte_count(size) is None:
                raise fail(
                    f"sharded(passes={{{key!r}: {shown(size)}}}) is not a number of bytes.",
                    f"give {key} as a number of bytes, e.g. 25 * 2**20 for 25 MiB"
                    + (", or None for the default" if key == "zero_bucket_bytes" else "")
                    + ".",
                )
            sizes[key] = _byte_count(size)
        spec = {**spec, **sizes}
        if not unknown:
            opts = replace(PassOptions(), **dict(spec))
            if opts.reduce_dtype is not None and not opts.cast:
                raise fail(
                    f"sharded(passes={shown(spec)}) sets reduce_dtype with the cast pass off; the cast "
                    "pass is what reduces gradients in that dtype, so it would be ignored.",
                    "leave 'cast' on (the default) to use reduce_dtype, or drop reduce_dtype.",
                )
            return opts
    elif isinstance(spec, (Sequence, set, frozenset)) and not isinstance(spec, str):
        unknown = set(spec) - set(NAMES)
        if not unknown:
            on: dict[str, Any] = {name: name in spec for name in NAMES}
            return PassOptions(**on)
    elif isinstance(spec, str) and spec in NAMES:
        raise fail(
            f"sharded(passes={spec!r}) is one name, not the set of passes to run.",
            f"pass a sequence of names, passes=[{spec!r}] (only that pass on), or a mapping, "
            f"passes={{{spec!r}: False}} (every default but that one).",
        )
    else:
        unknown = {spec}
    raise fail(
        f"sharded(passes={shown(spec)}) names no pass option ({sorted(map(shown, unknown))}).",
        f"use None (defaults), False (none), a sequence of {list(NAMES)}, or a mapping of those "
        "names to bools (plus 'bucket_bytes', 'zero_bucket_bytes', 'reduce_dtype', 'pack_early', "
        "'arena', 'fast_calls', 'fast_gelu' and 'memory_budget').",
    )


def eager_calls(opts: PassOptions) -> tuple[bool, bool]:
    """(``fast_calls``, ``fast_gelu``) for the eager runtime on a real mesh: both off where every
    pass is off (the program then runs as partitioned)."""
    on = any(getattr(opts, name) for name in NAMES)
    return (on and opts.fast_calls, on and opts.fast_gelu)


def _byte_count(x: Any) -> int | None:
    """``x`` as a whole number of bytes >= 0 (an int, a float such as 25e6, a NumPy or 0-dim torch
    number), or None for anything else (a string, a bool, a negative or fractional size)."""
    if isinstance(x, (str, bytes, bool)):
        return None
    try:
        n = float(x)
    except (TypeError, ValueError):
        return None
    return int(n) if n >= 0 and n == int(n) else None


Inputs = Sequence[tuple[Sequence[int], torch.dtype]]


def optimize(
    gm: GraphModule,
    inputs: Inputs,
    opts: PassOptions,
    backward: frozenset[str] = frozenset(),
    regions: Regions | None = None,
    regather_only: frozenset[str] | None = None,
    held_buckets: bool = False,
) -> GraphModule:
    """Run the chosen passes on one rank's program (``inputs``: its local input shapes and dtypes;
    ``backward``: the names of the traced ops that ran in backward, for ``regather`` and ``remat``;
    ``regions``: traced op name -> (remat region, kept by its policy), for ``remat``;
    ``regather_only``: the parameter gathers to issue again, None for all; ``held_buckets``: the
    runtime holds all-reduce buckets between calls, ``passes/held.py``)."""
    if not any((opts.views, opts.remat, opts.regather, opts.cast, opts.bucket, opts.inplace, opts.overlap)):
        return gm
    try:
        annotate(gm, inputs)
    except Exception:
        # fake collectives give every rank block 0's shape: on a rank whose uneven block is
        # shorter, shapes do not propagate (nor through an op without a fake kernel). Bucketing
        # needs them; the other passes do not.
        opts = replace(opts, bucket=False)
    original = gm
    gm = copy_module(gm)  # once: the passes below rewrite this copy in place (each also exists pure)
    if opts.views:
        views_(gm)
        norm_grads_(gm)
    if opts.regather or (opts.remat and regions) or opts.reduce_dtype is not None:
        mark_backward(gm, set(backward))
    if opts.remat and regions:
        remat_(gm, regions)
    if opts.regather:
        regather_(gm, regather_only)
        slice_early_(gm)
    if opts.cast:
        cast_(gm, opts.reduce_dtype)
    if opts.bucket:
        try:
            bucketing_(gm, opts.bucket_bytes, opts.zero_bucket_bytes)
            gm.graph.lint()
        except RuntimeError:  # a bucket placed a use before its launch: run this program unbucketed
            return optimize(
                original, inputs, replace(opts, bucket=False), backward, regions, regather_only, held_buckets
            )
    if opts.inplace:
        inplace_(gm)
    if opts.overlap:
        overlap_(gm)
    if opts.bucket and opts.pack_early:
        pack_early_(gm, held_buckets)
    if opts.views or opts.bucket:
        dense_results_(gm)
        dense_kernel_inputs_(gm)
    if held_buckets and opts.bucket and opts.pack_early:
        colocate_(gm)
    if held_buckets and opts.arena:
        arena_(gm)
    gm.recompile()
    return gm


def optimize_programs(
    programs: Sequence[GraphModule],
    inputs: Sequence[Inputs],
    opts: PassOptions,
    backward: frozenset[str] = frozenset(),
    regions: Regions | None = None,
    regather_only: frozenset[str] | None = None,
    held_buckets: bool = False,
) -> tuple[GraphModule, ...]:
    """Every rank's program; one shared program when the ranks share one (even layouts)."""
    if all(p is programs[0] for p in programs):
        done = optimize(programs[0], inputs[0], opts, backward, regions, regather_only, held_buckets)
        return (done,) * len(programs)
    # uneven layouts: fake collectives give every rank block 0's shape, so a rank whose block is
    # shorter would pack buckets by wrong sizes (even where propagation does not fail); never bucket
    opts = replace(opts, bucket=False)
    out = []
    for rank, (p, i) in enumerate(zip(programs, inputs, strict=True)):
        with fake_rank(rank):  # shapes propagate with this rank's own (shorter) blocks
            out.append(optimize(p, i, opts, backward, regions, regather_only, held_buckets))
    return tuple(out)


def schedule_programs(
    programs: Sequence[GraphModule],
    inputs: Sequence[Inputs],
    opts: PassOptions,
    backward: frozenset[str],
    regions: Regions | None,
    traced: Any,
    donated: Sequence[int],
    held_buckets: bool = False,
) -> tuple[GraphModule, ...]:
    """Every rank's finished program: the passes, then donation; under ``memory_budget`` the
    re-gathers that keep the predicted peak within it (``passes/budget.py``)."""

    def build(only: frozenset[str] | None) -> tuple[GraphModule, ...]:
        done = optimize_programs(programs, inputs, opts, backward, regions, only, held_buckets)
        return donate_programs(done, inputs, traced, donated) if donated else done

    if opts.memory_budget is None:
        return build(None)
    budget: int = opts.memory_budget
    if not all(p is programs[0] for p in programs):
        # uneven blocks: each rank has its own program, and the re-gather choice is made on rank
        # 0's nodes (running another rank's program built from it failed on a reshape)
        raise fail(
            f"sharded(memory_budget={budget:,}) needs every rank to hold blocks of one shape, but a "
            "spec splits a dimension its axes do not divide evenly, so ranks run different programs.",
            "make the split dimensions divisible by their axes' sizes (pad them), or drop "
            "memory_budget (the default schedule gathers every parameter backward reads again: "
            "the lowest peak).",
        )
    opts = replace(opts, regather=True)
    first = copy_module(programs[0])
    with contextlib.suppress(Exception):  # uneven blocks: shapes may not propagate; not needed here
        annotate(first, inputs[0])
    if opts.views:
        views_(first)
    mark_backward(first, set(backward))
    if opts.remat and regions:
        remat_(first, regions)
    order = candidates(first)
    built: dict[int, tuple[GraphModule, ...]] = {}
    peaks: dict[int, int] = {}

    def peak(k: int) -> int:
        if k not in peaks:
            built[k] = build(frozenset(order[:k]))
            distinct = {id(gm): (gm, ins) for gm, ins in zip(built[k], inputs, strict=True)}
            for gm, ins in distinct.values():
                annotate(gm, ins)
            peaks[k] = max(live_peak(gm) for gm, _ in distinct.values())
        return peaks[k]

    return built[fewest_regathers(budget, len(order), peak)]


def donate_programs(
    programs: Sequence[GraphModule], inputs: Sequence[Inputs], traced: Any, donated: Sequence[int]
) -> tuple[GraphModule, ...]:
    """Each rank's program writing its results into the donated inputs (``passes/donate.py``);
    a donated input the step returns unchanged is an error, since its buffer cannot be both."""
    placeholders = [n for n in traced.module.graph.nodes if n.op == "placeholder"]
    out = next(n for n in traced.module.graph.nodes if n.op == "output")
    returned = {_through_constrain(n) for n in out.all_input_nodes}
    for i in donated:
        if placeholders[i] in returned:
            raise fail(
                f"{traced.in_paths[i]} is donated (sharded(donate=...)) but the step returns it "
                "unchanged; a donated buffer is overwritten with the step's results.",
                f"do not donate the argument holding {traced.in_paths[i]}, or return a new value.",
            )
    if not all(p is programs[0] for p in programs):
        # uneven layouts: shape propagation gives every rank block 0's shapes, so a shorter block
        # would be written into a buffer of the wrong size; their programs keep fresh results
        return tuple(programs)
    done: dict[int, GraphModule] = {}
    for gm, ins in zip(programs, inputs, strict=True):
        if id(gm) not in done:
            new = copy_module(gm)
            try:
                annotate(new, ins)
            except Exception:
                done[id(gm)] = gm  # shapes unknown on this rank (uneven blocks): no donation
                continue
            donate_(new, donated, traced.in_paths, traced.out_paths)
            done[id(gm)] = new
    return tuple(done[id(gm)] for gm in programs)


def _through_constrain(n: Any) -> Any:
    """The value a result is, past ``constrain`` (which only pins a layout)."""
    while n.op == "call_function" and n.target is torch.ops.shardspec.constrain.default:
        n = n.args[0]
    return n


def launch_sequence(gm: GraphModule) -> tuple[tuple[Any, ...], ...]:
    """The collectives a program launches, in order, with what each rank must agree on."""
    return tuple(
        (
            str(n.target),
            tuple(sorted((k, v) for k, v in n.kwargs.items() if k != "size")),
            tuple(n.meta.get("shardspec_members", ())),
        )
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in LAUNCHES
    )


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "NAMES",
    "PassOptions",
    "bucketing",
    "cast",
    "dense_results",
    "donate_programs",
    "eager_calls",
    "inplace",
    "launch_sequence",
    "optimize",
    "options",
    "overlap",
    "pack_early",
    "regather",
    "remat",
    "schedule_programs",
    "slice_early",
    "views",
]
