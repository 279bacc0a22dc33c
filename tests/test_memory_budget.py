"""``sharded(memory_budget=...)`` (compiler/passes/budget.py): ZeRO-3's keep-or-re-gather choice made
per parameter under a peak the user sets, and gradients packed into their bucket as they are computed
(compiler/passes/pack_early.py). Peaks are ``cost()``'s predictions, which tests/test_memory.py
checks against the live storage measured on a simulated mesh."""

from __future__ import annotations

import optree
import pytest
import torch

import shardspec
from shardspec import Mesh, P, ShardingError, optim, sharded

OPT = optim.adamw(lr=1e-3)
LAYERS, D, N = 6, 64, 4
SMALL = {"zero_bucket_bytes": 4096}  # a bucket per weight: re-gathering one frees one
aten = torch.ops.aten
SPLIT = P("dp")


def _loss(p, x, y):
    h = x
    for i in range(LAYERS):
        h = torch.tanh(h @ p[f"w{i}"])
    return torch.nn.functional.cross_entropy(h, y)


def _step(p, s, x, y):
    loss, g = shardspec.value_and_grad(_loss)(p, x, y)
    p, s = OPT.update(g, s, p)
    return p, s, loss


def _args():
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(D, D, generator=g) / D**0.5 for i in range(LAYERS)}
    x, y = torch.randn(16, D, generator=g), torch.randint(0, D, (16,), generator=g)
    return params, OPT.init(params), x, y


def _compiled(spec=SPLIT, **kw):
    specs = {f"w{i}": spec for i in range(LAYERS)}
    return sharded(
        _step,
        mesh=Mesh({"dp": N}, simulate=True),
        in_specs=(specs, OPT.state_specs(specs), P("dp"), P("dp")),
        out_specs=(specs, OPT.state_specs(specs), P()),
        donate=(0, 1),
        **kw,
    )


def _cost(**kw):
    return _compiled(**kw).lower(*_args()).cost()


def test_bytes_fall_as_the_budget_grows_and_the_peak_stays_within_it():
    keep = _cost(passes={**SMALL, "regather": False})
    again = _cost(passes=SMALL)
    assert again.peak_memory_bytes_per_rank < keep.peak_memory_bytes_per_rank  # the trade exists
    assert again.comm_bytes_per_rank > keep.comm_bytes_per_rank
    lo, hi = again.peak_memory_bytes_per_rank, keep.peak_memory_bytes_per_rank
    budgets = [lo + (hi - lo) * k // 4 for k in range(5)] + [2 * hi]
    costs = [_cost(passes=SMALL, memory_budget=b) for b in budgets]
    for b, c in zip(budgets, costs, strict=True):
        assert c.peak_memory_bytes_per_rank <= b
    sent = [c.comm_bytes_per_rank for c in costs]
    assert sent == sorted(sent, reverse=True) and sent[0] > sent[-1]
    assert sent[-1] == keep.comm_bytes_per_rank  # room for everything: no gather issued twice
    assert sent[0] <= again.comm_bytes_per_rank  # the tightest: at most every one again


def test_a_budgeted_step_computes_the_unbudgeted_one():
    args = _args()
    mid = (
        _cost(passes=SMALL).peak_memory_bytes_per_rank
        + _cost(passes=SMALL | {"regather": False}).peak_memory_bytes_per_rank
    ) // 2
    got = _compiled(passes=SMALL, memory_budget=mid)(*[optree.tree_map(torch.clone, a) for a in args])
    want = _compiled(passes=SMALL)(*[optree.tree_map(torch.clone, a) for a in args])
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [P("dp"), P()], ids=["zero3", "dp"])
def test_a_budget_no_schedule_meets_is_an_error_naming_it_and_the_fix(spec):
    lowest = min(
        _cost(spec=spec, passes=SMALL).peak_memory_bytes_per_rank,
        _cost(spec=spec, passes={**SMALL, "regather": False}).peak_memory_bytes_per_rank,
    )
    with pytest.raises(ShardingError) as err:
        _compiled(spec=spec, passes=SMALL, memory_budget=lowest - 1).lower(*_args())
    msg = str(err.value)
    assert f"memory_budget={lowest - 1:,}" in msg and "no schedule of this step fits" in msg
    assert f"lowest predicted peak is {lowest:,} bytes per rank" in msg
    for fix in ("more devices", "P('dp')", "donate", "shardspec.remat", f"at least {lowest:,}"):
        assert fix in msg
    assert "Traceback" not in msg


@pytest.mark.parametrize("bad", [0, -5, "8GB", True])
def test_memory_budget_must_be_a_positive_number_of_bytes(bad):
    with pytest.raises(ShardingError, match=r"memory_budget=.*positive number of bytes per rank"):
        _compiled(memory_budget=bad)


def test_gradients_are_copied_into_their_bucket_as_soon_as_computed():
    """DP: one all-reduce bucket. Packed at its last member, every gradient and the flat buffer are
    live together; packed as computed, each gradient dies at its copy (or is computed in the bucket),
    so the peak falls by up to the gradients' bytes, with the same results and bytes sent."""
    on, off = _compiled(spec=P()), _compiled(spec=P(), passes={"pack_early": False})
    args = _args()
    low_on, low_off = on.lower(*args), off.lower(*args)
    assert low_on.cost().comm_bytes_per_rank == low_off.cost().comm_bytes_per_rank
    assert low_on.cost().peak_memory_bytes_per_rank < low_off.cost().peak_memory_bytes_per_rank
    gm = low_on.program.programs[0]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    flats = {n for n in nodes if n.target is aten.new_empty.default}
    copies = [
        n
        for n in nodes
        if n.target is aten.copy_.default
        and n.args[0].target is aten.slice.Tensor
        and n.args[0].args[0] in flats
    ]
    into = [  # a weight gradient's mm written straight into its slice: no buffer of its own
        n for n in nodes if n.target is aten.mm.out and n.kwargs["out"].args[0].args[0] in flats
    ]
    assert len(copies) + len(into) >= LAYERS and into  # every weight's gradient (and the loss's scalars)
    for c in copies:  # each gradient (through views) is last read by its copy into the bucket
        src = c.args[1]
        while src.op == "call_function" and src.target in (aten.reshape.default, aten.view.default):
            src = src.args[0]
        assert max(pos[u] for u in src.users) <= pos[c]
    got = on(*[optree.tree_map(torch.clone, a) for a in args])
    want = off(*[optree.tree_map(torch.clone, a) for a in args])
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_budget_on_uneven_blocks_is_refused_with_the_fix():
    opt = optim.sgd(lr=0.1)

    def step(p, x):
        loss, g = shardspec.value_and_grad(lambda p, x: (x @ p["w"] + p["b"]).pow(2).sum())(p, x)
        return opt.update(g, {}, p)[0], loss

    sp = {"w": P("dp"), "b": P("dp")}  # b's 5 entries over dp=2: blocks of 3 and 2
    f = sharded(
        step,
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(sp, P("dp")),
        out_specs=(sp, P()),
        memory_budget=10**9,
    )
    with pytest.raises(
        ShardingError, match=r"p\['b'\] \(shape \(5,\), spec P\('dp'\): dim 0 of size 5 over 2"
    ) as e:
        f({"w": torch.randn(4, 5), "b": torch.randn(5)}, torch.randn(4, 4))
    assert "memory_budget=1,000,000,000" in str(e.value) and "drop memory_budget" in str(e.value)
    assert "divisible" in str(e.value)
