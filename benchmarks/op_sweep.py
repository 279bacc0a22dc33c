"""Op coverage: every float32 OpInfo sample through @sharded on a simulated 2x2 mesh with random
input specs, and the same samples through DTensor on a 4-process gloo world, each against eager.

    python -m benchmarks.op_sweep                     # all ops, 2 samples each, both sides
    python -m benchmarks.op_sweep --ops 40 --no-dtensor

Each sample is classified: pass; missing rule; refused (a clear error for a program the compiler does
not take by design: data-dependent control flow or shapes, in-place updates of arguments, random
numbers); mismatch (a wrong answer: a bug); error (anything else); or skipped (non-tensor or
uninitialized results, random ops, sparse layouts). An op passes when all its samples do.
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
REFUSED = (
    "depends on tensor values",
    "modified in place",
    "random numbers",
    "shape that depends",
    "reads a tensor's value as a Python number",
)
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


def _grad_slots(case: Case) -> list[int]:
    """Positions (among tensor leaves) of the floating inputs gradients are taken for."""
    tensors = [x for x in case.leaves if isinstance(x, torch.Tensor)]
    return [i for i, t in enumerate(tensors) if t.is_floating_point()]


def _loss_of(call: Any, weights: list[torch.Tensor]) -> Any:
    """A scalar that mixes every floating output with fixed weights, so each output's gradient counts."""

    def loss(*tensors: torch.Tensor) -> torch.Tensor:
        outs = [o for o in optree.tree_leaves(call(*tensors), none_is_leaf=True) if _differentiable(o)]
        terms = [(o * w).sum() for o, w in zip(outs, weights, strict=True)]
        total = terms[0]
        for t in terms[1:]:
            total = total + t
        return total

    return loss


def _differentiable(o: Any) -> bool:
    return isinstance(o, torch.Tensor) and o.is_floating_point()


def _weights(want: Any, case: Case) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(hash((case.op, case.variant, case.index)) % 2**31)
    outs = [o for o in optree.tree_leaves(want, none_is_leaf=True) if _differentiable(o)]
    return [torch.randn(o.shape, generator=g) for o in outs]


def eager_grads(case: Case, want: Any) -> list[torch.Tensor] | None:
    """Reference gradients of the weighted loss (None when eager autograd does not handle the op)."""
    tensors = [x.detach().clone() for x in case.leaves if isinstance(x, torch.Tensor)]
    slots = _grad_slots(case)
    if not slots:
        return None
    for i in slots:
        tensors[i].requires_grad_(True)
    try:
        weights = _weights(want, case)
        if not weights:
            return None
        loss = _loss_of(_caller(case), weights)(*tensors)
        if not loss.requires_grad:
            return None
        grads = torch.autograd.grad(loss, [tensors[i] for i in slots], allow_unused=True)
    except Exception:
        return None
    return [torch.zeros_like(tensors[i]) if g is None else g for i, g in zip(slots, grads, strict=True)]


def _same(got: Any, want: Any) -> bool:
    g, w = optree.tree_leaves(got, none_is_leaf=True), optree.tree_leaves(want, none_is_leaf=True)
    if len(g) != len(w):
        return False
    for a, b in zip(g, w, strict=True):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape:
                return False
            wide = torch.complex128 if b.is_complex() else torch.float64  # .double() drops imaginary parts
            if not torch.allclose(a.to(wide), b.to(wide), rtol=1e-4, atol=1e-5, equal_nan=True):
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
    if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in [*case.leaves, *outs]):
        return "sparse layout"  # neither side shards sparse tensors
    return None


def run_ours(case: Case, mesh: Mesh, backward: bool = False) -> str:
    """Classify one sample through @sharded: the op's results, or (``backward``) the gradients of a
    weighted sum of its results with respect to its floating inputs, taken inside the step."""
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
    if backward:
        grads = eager_grads(case, want)
        if grads is None:
            return "skipped"
        slots = _grad_slots(case)
        loss = _loss_of(call, _weights(want, case))
        call = _grads_step(loss, slots)
        want, out_specs = grads, [P() for _ in grads]
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


def _grads_step(loss: Any, slots: list[int]) -> Any:
    from shardspec import value_and_grad

    def step(*tensors: torch.Tensor) -> list[torch.Tensor]:
        def of(*diff: torch.Tensor) -> torch.Tensor:
            full = list(tensors)
            for i, d in zip(slots, diff, strict=True):
                full[i] = d
            return loss(*full)

        _, grads = value_and_grad(of, argnums=tuple(range(len(slots))))(*(tensors[i] for i in slots))
        return list(grads)

    return step


def run_dtensor_rank(rank: int, world: int, cases: list[Case], backward: bool = False) -> list[str]:
    """On one rank of a 4-process gloo world: each case through DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

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
        grads = eager_grads(case, want) if backward else None
        if backward and grads is None:
            out.append("skipped")
            continue
        try:
            dts = [
                distribute_tensor(t, mesh.device_mesh, list(spec_to_placements(s, mesh, tuple(t.shape))))
                for t, s in zip(tensors, case.specs, strict=True)
            ]
            if backward:
                slots = _grad_slots(case)
                for i in slots:
                    dts[i].requires_grad_(True)
                weights = [
                    distribute_tensor(w, mesh.device_mesh, [Replicate()] * 2) for w in _weights(want, case)
                ]
                loss = _loss_of(call, weights)(*dts)
                got = list(torch.autograd.grad(loss, [dts[i] for i in slots], allow_unused=True))
                got = [torch.zeros_like(dts[i]) if g is None else g for i, g in zip(slots, got, strict=True)]
                want = grads
            else:
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


def _table(title: str, rows: list[tuple[str, Counter[str], float]]) -> None:
    print(f"\n{title}")
    print("| side | ops pass | missing rule | refused | mismatch | error | skipped | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, c, secs in rows:
        print(
            f"| {name} | {c['pass']} | {c['missing rule']} | {c['refused']} | {c['mismatch']} | "
            f"{c['error']} | {c['skipped']} | {secs:.0f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=None, help="only the first N OpInfos")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-dtensor", action="store_true")
    ap.add_argument("--no-backward", action="store_true", help="forward results only")
    args = ap.parse_args()
    cases = build_cases(args.ops, args.samples, args.seed)
    mesh = Mesh({"x": 2, "y": 2}, simulate=True)
    n_ops = len({(c.op, c.variant) for c in cases})
    print(
        f"{len(cases)} samples of {n_ops} ops (float32, mesh x=2 x y=2, random input specs, seed {args.seed})"
    )
    for backward in (False,) if args.no_backward else (False, True):
        t0 = time.time()
        ours = [run_ours(c, mesh, backward) for c in cases]
        t1 = time.time()
        ours_count, ours_ops = summarize(cases, ours)
        rows = [("shardspec @sharded", ours_count, t1 - t0)]
        dt_ops: dict[str, str] = {}
        if not args.no_dtensor:
            from shardspec.testing import run_distributed

            dt = run_distributed(run_dtensor_rank, 4, args=(cases, backward), timeout=3600)[0]
            dt_count, dt_ops = summarize(cases, dt)
            rows.append(("DTensor", dt_count, time.time() - t1))
        _table("gradients (backward)" if backward else "results (forward)", rows)
        for status in ("mismatch", "error", "refused", "missing rule"):
            names = sorted(k for k, v in ours_ops.items() if v == status)
            print(f"shardspec {status}: {', '.join(names) if names else 'none'}")
        if not args.no_dtensor:
            names = sorted(k for k, v in dt_ops.items() if v == "mismatch")
            print(f"DTensor mismatch: {', '.join(names) if names else 'none'}")


if __name__ == "__main__":
    main()
