"""Op coverage: every float32 OpInfo sample through @sharded on a simulated 2x2 mesh with random
input specs, and the same samples through DTensor on a 4-process gloo world, each against eager.

    python -m benchmarks.op_sweep                     # all ops, 2 samples each, both sides
    python -m benchmarks.op_sweep --ops 40 --no-dtensor

Each sample is classified: pass; missing rule; refused (a clear error for a program the compiler does
not take by design: data-dependent control flow or shapes, in-place updates of arguments, random
numbers); mismatch (a wrong answer: a bug); error (anything else); or skipped (non-tensor or
uninitialized results, random ops). An op passes when all its samples do.
"""

from __future__ import annotations

import argparse
import random
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import optree
import torch

from shardspec import Mesh, P, ShardingError

AXES = ("x", "y")
UNINITIALIZED = ("empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted")
REFUSED = ("depends on tensor values", "modified in place", "random numbers", "shape that depends")
RANDOM_NAMES = (
    "rand",
    "normal",
    "bernoulli",
    "dropout",
    "multinomial",
    "uniform",
    "randint",
    "randn",
    "cauchy",
    "exponential",
    "geometric",
    "log_normal",
    "poisson",
)


@dataclass
class Case:
    op: str
    variant: str
    index: int
    leaves: list[Any]
    tree: Any
    specs: list[P]  # one per tensor leaf


def _op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if torch.float32 in o.supported_dtypes("cpu")]


def _key(o: Any) -> str:
    return o.name + ("." + o.variant_test_name if o.variant_test_name else "")


def _random_spec(t: torch.Tensor, rng: random.Random) -> P:
    free = list(AXES)
    entries: list[Any] = []
    for _ in range(t.dim()):
        if free and rng.random() < 0.5:
            entries.append(free.pop(rng.randrange(len(free))))
        else:
            entries.append(None)
    return P(*entries)


def build_cases(max_ops: int | None, samples: int, seed: int) -> list[Case]:
    cases = []
    ops = _op_db()[:max_ops] if max_ops else _op_db()
    for o in ops:
        torch.manual_seed(seed)
        rng = random.Random(f"{seed}-{_key(o)}")
        try:
            got = []
            for i, s in enumerate(o.sample_inputs("cpu", torch.float32, requires_grad=False)):
                if i >= samples:
                    break
                got.append(s)
        except Exception:
            continue
        for i, s in enumerate(got):
            leaves, tree = optree.tree_flatten((s.input, s.args, s.kwargs), none_is_leaf=True)
            specs = [_random_spec(x, rng) for x in leaves if isinstance(x, torch.Tensor)]
            cases.append(Case(o.name, o.variant_test_name, i, leaves, tree, specs))
    return cases


def _op(case: Case) -> Any:
    return next(o for o in _op_db() if o.name == case.op and o.variant_test_name == case.variant).op


def _caller(case: Case) -> Any:
    op = _op(case)
    slots = [i for i, x in enumerate(case.leaves) if isinstance(x, torch.Tensor)]

    def call(*tensors: torch.Tensor) -> Any:
        leaves = list(case.leaves)
        for i, t in zip(slots, tensors, strict=True):
            leaves[i] = t
        inp, args, kwargs = optree.tree_unflatten(case.tree, leaves)
        return op(inp, *args, **kwargs)

    return call


def _same(got: Any, want: Any) -> bool:
    g, w = optree.tree_leaves(got, none_is_leaf=True), optree.tree_leaves(want, none_is_leaf=True)
    if len(g) != len(w):
        return False
    for a, b in zip(g, w, strict=True):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape:
                return False
            if not torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5, equal_nan=True):
                return False
        elif a != b:
            return False
    return True


def _skip_reason(case: Case, want: Any) -> str | None:
    if any(k in case.op for k in RANDOM_NAMES):
        return "random op"
    if case.op in UNINITIALIZED:
        return "uninitialized result"
    outs = optree.tree_leaves(want, none_is_leaf=True)
    if not outs or not all(isinstance(x, torch.Tensor) for x in outs):
        return "non-tensor result"
    return None


def run_ours(case: Case, mesh: Mesh) -> str:
    from shardspec import sharded

    call = _caller(case)
    tensors = [x for x in case.leaves if isinstance(x, torch.Tensor)]
    try:
        want = call(*tensors)
    except Exception:
        return "skipped"
    if _skip_reason(case, want):
        return "skipped"
    out_specs = optree.tree_map(lambda _: P(), want, none_is_leaf=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = sharded(call, mesh=mesh, in_specs=tuple(case.specs), out_specs=out_specs)(*tensors)
    except ShardingError as e:
        if "no sharding rule" in str(e):
            return "missing rule"
        return "refused" if any(k in str(e) for k in REFUSED) else "error"
    except Exception:
        return "error"
    return "pass" if _same(got, want) else "mismatch"


def run_dtensor_rank(rank: int, world: int, cases: list[Case]) -> list[str]:
    """On one rank of a 4-process gloo world: each case through DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from shardspec.placements import spec_to_placements

    mesh = Mesh({"x": 2, "y": 2})
    out = []
    for case in cases:
        call = _caller(case)
        tensors = [x for x in case.leaves if isinstance(x, torch.Tensor)]
        try:
            want = call(*tensors)
        except Exception:
            out.append("skipped")
            continue
        if _skip_reason(case, want):
            out.append("skipped")
            continue
        try:
            dts = [
                distribute_tensor(t, mesh.device_mesh, list(spec_to_placements(s, mesh, tuple(t.shape))))
                for t, s in zip(tensors, case.specs, strict=True)
            ]
            got = call(*dts)
            got = optree.tree_map(
                lambda v: v.full_tensor() if isinstance(v, DTensor) else v, got, none_is_leaf=True
            )
            out.append("pass" if _same(got, want) else "mismatch")
        except NotImplementedError as e:
            out.append(
                "missing rule"
                if "sharding strateg" in str(e) or "not implemented" in str(e).lower()
                else "error"
            )
        except Exception:
            out.append("error")
    return out


def summarize(cases: list[Case], results: list[str]) -> tuple[Counter[str], dict[str, str]]:
    """Per-op status: skipped when every sample was skipped, else the worst of the rest (an op
    passes only when all its samples pass); and the count of ops per status."""
    order = ["mismatch", "error", "missing rule", "refused", "pass"]
    seen: dict[str, list[str]] = {}
    for c, r in zip(cases, results, strict=True):
        seen.setdefault(c.op + ("." + c.variant if c.variant else ""), []).append(r)
    per_op = {}
    for name, rs in seen.items():
        kept = [r for r in rs if r != "skipped"]
        per_op[name] = min(kept, key=order.index) if kept else "skipped"
    return Counter(per_op.values()), per_op


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=None, help="only the first N OpInfos")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-dtensor", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    cases = build_cases(args.ops, args.samples, args.seed)
    mesh = Mesh({"x": 2, "y": 2}, simulate=True)
    ours = [run_ours(c, mesh) for c in cases]
    t1 = time.time()
    ours_count, ours_ops = summarize(cases, ours)
    rows = [("shardspec @sharded", ours_count, t1 - t0)]
    dt_ops: dict[str, str] = {}
    if not args.no_dtensor:
        from shardspec.testing import run_distributed

        dt = run_distributed(run_dtensor_rank, 4, args=(cases,), timeout=3600)[0]
        dt_count, dt_ops = summarize(cases, dt)
        rows.append(("DTensor", dt_count, time.time() - t1))
    print(
        f"{len(cases)} samples of {len(ours_ops)} ops (float32, mesh x=2 x y=2, random input specs, "
        f"seed {args.seed})"
    )
    print("| side | ops pass | missing rule | refused | mismatch | error | skipped | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, c, secs in rows:
        print(
            f"| {name} | {c['pass']} | {c['missing rule']} | {c['refused']} | {c['mismatch']} | "
            f"{c['error']} | {c['skipped']} | {secs:.0f} |"
        )
    for status in ("mismatch", "error", "refused", "missing rule"):
        names = sorted(k for k, v in ours_ops.items() if v == status)
        print(f"shardspec {status}: {', '.join(names) if names else 'none'}")
    if not args.no_dtensor:
        names = sorted(k for k, v in dt_ops.items() if v == "mismatch")
        print(f"DTensor mismatch: {', '.join(names) if names else 'none'}")


if __name__ == "__main__":
    main()
