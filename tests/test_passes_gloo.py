"""Program passes on 2 gloo processes: DP and ZeRO-3 train with bucketed, async, in-place collectives
and match a single process step by step; gradient buckets are really in flight while backward runs."""

from __future__ import annotations

import optree
import pytest
import torch
from torch.fx import Interpreter

from examples.models import mlp
from shardspec import optim
from shardspec.testing import run_distributed
from tests.mlp_strategies import batch

pytestmark = pytest.mark.multiprocess
STEPS = 3
PASSES = {"bucket_bytes": 64}  # one bucket per gradient of the small MLP: several launches
OPT = optim.adamw(lr=1e-2, weight_decay=0.1)


def _specs(strategy):
    from shardspec import P

    split = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
    pspec = {"w1": P(), "b1": P(), "w2": P()} if strategy == "dp" else split
    return pspec, OPT.state_specs(pspec)


def train(rank: int, world: int, strategy: str) -> dict[str, object]:
    import collectives as C
    from collectives import distributed
    from shardspec import Mesh, P, sharded
    from shardspec.layout import device_slices

    mesh = Mesh({"dp": world})
    pspec, sspec = _specs(strategy)
    step = mlp.make_step(OPT)
    f = sharded(
        step,
        mesh=mesh,
        in_specs=(pspec, sspec, P("dp"), P("dp")),
        out_specs=(pspec, sspec, P()),
        passes=PASSES,
    )
    params = mlp.init(8, 16, 4)
    state = OPT.init(params)
    program = f.lower(params, state, *batch(0)).program
    losses, sent, planned = [], [], []
    for i in range(STEPS):
        x, y = batch(i)
        planned.append(f.lower(params, state, x, y).cost().comm_bytes_per_rank)
        with C.count_bytes() as counter:
            params, state, loss = f(params, state, x, y)
        sent.append(counter.total_bytes_per_rank)
        losses.append(loss.full_tensor())

    # run the program once more, watching each wait: was its collective still in flight?
    args = (mlp.init(8, 16, 4), OPT.init(mlp.init(8, 16, 4)), *batch(0))
    leaves = optree.tree_leaves(args)
    local = [
        (t := leaves[i])[device_slices(tuple(t.shape), mesh, s, rank)].contiguous()
        for i, s in zip(program.traced.tensor_positions, program.in_specs, strict=True)
    ]
    pending_at_wait = []

    class Watch(Interpreter):
        def run_node(self, n):
            if n.target is torch.ops.shardspec.wait.default:
                x = self.env[n.args[0]]
                pending_at_wait.append((x.untyped_storage().data_ptr(), x.data_ptr()) in distributed._pending)
            return super().run_node(n)

    with torch.no_grad():
        Watch(program.programs[rank]).run(*local)
    return {
        "losses": losses,
        "params": {k: v.full_tensor() for k, v in params.items()},
        "sent": sent,
        "planned": planned,
        "in_flight": sum(pending_at_wait),
        "waits": len(pending_at_wait),
    }


def _reference():
    step = mlp.make_step(OPT)
    params = mlp.init(8, 16, 4)
    state = OPT.init(params)
    losses = []
    for i in range(STEPS):
        params, state, loss = step(params, state, *batch(i))
        losses.append(loss)
    return params, losses


@pytest.mark.parametrize("same_host", ["1", "0"], ids=["same-host", "gloo"])
@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_passes_on_two_processes_match_a_single_process(strategy, same_host):
    """Equal to one process through either transport, the async collectives really pending at their
    waits (gloo's in flight, the same-host ones run there)."""
    want_params, want_losses = _reference()
    env = {"SHARDSPEC_SAME_HOST": same_host}
    for r in run_distributed(train, 2, args=(strategy,), timeout=240, env=env):
        for got, want in zip(r["losses"], want_losses, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for k in want_params:
            torch.testing.assert_close(r["params"][k], want_params[k], rtol=1e-5, atol=1e-6)
        assert r["sent"] == r["planned"]
        assert r["waits"] >= 3 and r["in_flight"] >= 1


def test_gradient_buckets_are_issued_before_backward_ends():
    from shardspec import Mesh, P, sharded

    pspec, sspec = _specs("dp")
    mesh = Mesh({"dp": 2}, simulate=True)
    f = sharded(
        mlp.make_step(OPT),
        mesh=mesh,
        in_specs=(pspec, sspec, P("dp"), P("dp")),
        out_specs=(pspec, sspec, P()),
        passes=PASSES,
    )
    params = mlp.init(8, 16, 4)
    program = f.lower(params, OPT.init(params), *batch(0)).program
    nodes = list(program.programs[0].graph.nodes)
    origin = {n.name: n for n in program.traced.module.graph.nodes}

    def backward(n):
        o = origin.get(n.meta.get("shardspec_origin", ""))
        return o is not None and "backward of" in (o.meta.get("stack_trace") or "")

    last_backward = max(i for i, n in enumerate(nodes) if backward(n))
    launches = [i for i, n in enumerate(nodes) if n.kwargs.get("async_op") and "all_reduce" in str(n.target)]
    grads = [i for i in launches if nodes[i].meta.get("val") is not None and nodes[i].meta["val"].dim() > 0]
    assert grads and min(grads) < last_backward  # the first bucket goes out while backward runs


def held_buckets(rank: int, world: int) -> dict[str, object]:
    """DP steps on a real mesh: the gradient bucket is one buffer across calls, filled as gradients
    are computed (weight gradients written into it), the loss a tensor of its own; a step returning
    its gradients (views of the bucket) does not hold it."""
    import shardspec
    from shardspec import Mesh, P, sharded

    mesh = Mesh({"dp": world})
    pspec, sspec = _specs("dp")
    f = sharded(
        mlp.make_step(OPT),
        mesh=mesh,
        in_specs=(pspec, sspec, P("dp"), P("dp")),
        out_specs=(pspec, sspec, P()),
    )
    params = mlp.init(8, 16, 4)
    state = OPT.init(params)
    program = f.lower(params, state, *batch(0)).program
    buffers, loss_bytes = [], []
    for i in range(STEPS):
        params, state, loss = f(params, state, *batch(i))
        held = [m for m in f._plans[id(program)].held.modules() if hasattr(m, "held")]
        buffers.append([m.held[0].data_ptr() for m in held])
        loss_bytes.append(loss.to_local().untyped_storage().nbytes())

    def grads(p, x, y):
        return shardspec.value_and_grad(mlp.loss_fn)(p, x, y)

    g = sharded(grads, mesh=mesh, in_specs=(pspec, P("dp"), P("dp")), out_specs=(P(), pspec))
    first = g(mlp.init(8, 16, 4), *batch(0))[1]
    kept = {k: v.to_local().clone() for k, v in first.items()}
    g(mlp.init(8, 16, 4), *batch(1))  # must not write into the first call's gradients
    nodes = list(f._plans[id(program)].held.graph.nodes)
    bucket = next(i for i, n in enumerate(nodes) if n.op == "call_module")
    into = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.out]
    return {
        "held": len(held),
        "into_bucket": [
            nodes[bucket] in nodes[i].kwargs["out"].all_input_nodes[0].all_input_nodes for i in into
        ],
        "bucket_before_first_gradient": bool(into) and bucket < min(into),
        "buffers": buffers,
        "loss_bytes": loss_bytes,
        "params": {k: v.full_tensor() for k, v in params.items()},
        "first_grads_unchanged": all(torch.equal(first[k].to_local(), kept[k]) for k in kept),
    }


def test_dp_gradient_bucket_is_held_across_calls_and_results_stay_their_own():
    want_params, _ = _reference()
    for r in run_distributed(held_buckets, 2, timeout=240):
        assert r["held"] == 1
        # held, the bucket costs nothing before it is written: it is filled from the first gradient
        # on, and both weight gradients are computed straight into it (no buffer of their own)
        assert r["bucket_before_first_gradient"] and r["into_bucket"] == [True, True]
        assert r["buffers"][0] == r["buffers"][1] == r["buffers"][2]
        assert r["loss_bytes"] == [4, 4, 4]  # not a view of the bucket (it would keep it alive)
        for k in want_params:
            torch.testing.assert_close(r["params"][k], want_params[k], rtol=1e-5, atol=1e-6)
        assert r["first_grads_unchanged"]
