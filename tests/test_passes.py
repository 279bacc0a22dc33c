"""Program passes (compiler/passes): the sharded step computes the same with every pass on and with
every pass off, sends the same bytes in fewer launches, issues gradient reductions during backward,
and every rank launches the same collectives in the same order."""

from __future__ import annotations

import dataclasses
import math
import re

import optree
import pytest
import torch

import collectives
import shardspec
from compiler import passes as cp
from compiler.passes import launch_sequence
from examples.models import gpt, mlp
from shardspec import Mesh, P, ShardingError, optim, sharded
from tests.mlp_strategies import batch, specs
from tests.transformer_specs import configurations

OPT = optim.adamw(lr=1e-2, weight_decay=0.1)
GPT_OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)  # see test_transformers (zero key-bias grad)
OFF = False
SMALL = {"bucket_bytes": 256}  # several buckets even on the small models
LAUNCH = {"all_reduce", "all_reduce_inplace", "reduce_scatter", "all_gather", "all_to_all"}


def _mlp_case(strategy):
    if strategy == "zero1":
        rep = {"w1": P(), "b1": P(), "w2": P()}
        split = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
        return {"dp": 4}, rep, OPT.state_specs(split), P("dp")
    return specs(strategy, OPT)


def _run_steps(f, step, params, state, data, steps=2):
    """Two sharded steps, the second from the first's results, against the unsharded steps."""
    want_p, want_s = params, state
    got_p, got_s = params, state
    results = []
    for i in range(steps):
        x, y = data(i)
        got_p, got_s, got_loss = f(got_p, got_s, x, y)
        want_p, want_s, want_loss = step(want_p, want_s, x, y)
        results.append((got_p, got_s, got_loss))
        for a, b in zip(
            optree.tree_leaves((got_p, got_s, got_loss)), optree.tree_leaves((want_p, want_s, want_loss))
        ):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return results


def _same(a, b):
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero3", "megatron", "dp_x_tp"])
def test_mlp_strategies_equal_with_passes_on_and_off(strategy):
    axes, pspec, sspec, bspec = _mlp_case(strategy)
    mesh = Mesh(axes, simulate=True)
    step = mlp.make_step(OPT)
    params = mlp.init(8, 16, 4)
    state = OPT.init(params)
    out = {}
    for name, passes in (("on", None), ("small", SMALL), ("off", OFF)):
        f = sharded(
            step,
            mesh=mesh,
            in_specs=(pspec, sspec, bspec, bspec),
            out_specs=(pspec, sspec, P()),
            passes=passes,
        )
        out[name] = _run_steps(f, step, params, state, batch)
        low = f.lower(params, state, *batch(0))
        with collectives.count_bytes() as counter:
            f(params, state, *batch(0))
        assert counter.total_bytes_per_rank == low.cost().comm_bytes_per_rank  # plan == backend
        assert counter.count == low.cost().collective_count * _groups(mesh, low)
        out[name + "_cost"] = _without_regather(low)
    _same(out["on"], out["off"])
    _same(out["small"], out["off"])
    assert out["on_cost"].comm_bytes_per_rank == out["off_cost"].comm_bytes_per_rank
    assert out["on_cost"].collective_count <= out["off_cost"].collective_count


def _without_regather(low):
    """The cost less the parameter gathers issued again for backward (the regather pass's trade)."""
    cost = low.cost()
    again = sum(c.bytes_per_rank for launch in low.launches() for c in launch if c.node.endswith("@regather"))
    return dataclasses.replace(cost, comm_bytes_per_rank=cost.comm_bytes_per_rank - again)


def _groups(mesh, low):
    """Backend records per launch: one per group of the launch's axes."""
    axes = {c.axes for c in low.collectives()}
    sizes = {mesh.size // math.prod(mesh.shape[a] for a in ax) for ax in axes}
    assert len(sizes) <= 1
    return sizes.pop() if sizes else 1


def _gpt(config, passes, cfg=None):
    cfg = cfg or gpt.Config()
    params = gpt.init(cfg)
    pspec, bspec, residual = configurations(params)[config]
    cfg = dataclasses.replace(cfg, residual=residual)

    def loss_fn(p, tok, tgt):
        return gpt.loss_fn(p, tok, tgt, cfg)

    def step(p, s, tok, tgt):
        loss, grads = shardspec.value_and_grad(loss_fn)(p, tok, tgt)
        p, s = GPT_OPT.update(grads, s, p)
        return p, s, loss

    def data(i):
        g = torch.Generator().manual_seed(i)
        return tuple(torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g) for _ in range(2))

    f = sharded(
        step,
        mesh=Mesh({"dp": 2, "tp": 2}, simulate=True),
        in_specs=(pspec, GPT_OPT.state_specs(pspec), bspec, bspec),
        out_specs=(pspec, GPT_OPT.state_specs(pspec), P()),
        passes=passes,
    )
    return f, step, params, GPT_OPT.init(params), data


@pytest.mark.parametrize("config", ["dp", "zero3", "tp_megatron", "dp_x_tp"])
def test_gpt_equal_with_passes_on_and_off(config):
    results = {}
    for name, passes in (("on", SMALL), ("off", OFF)):
        f, step, params, state, data = _gpt(config, passes)
        results[name] = _run_steps(f, step, params, state, data)
        results[name + "_cost"] = _without_regather(f.lower(params, state, *data(0)))
    _same(results["on"], results["off"])
    assert results["on_cost"].comm_bytes_per_rank == results["off_cost"].comm_bytes_per_rank
    if config == "tp_megatron":  # every collective is an activation's, needed at once: none to merge
        assert results["on_cost"].collective_count == results["off_cost"].collective_count
    else:
        assert results["on_cost"].collective_count < results["off_cost"].collective_count


def _ddp_buckets(sizes, cap):
    """DDP's count: gradients in reverse order, a first bucket of 1 MiB, then ``cap``; a bucket
    closes once it holds its limit."""
    limits, count, held = [min(1 << 20, cap), cap], 0, 0
    for size in reversed(sizes):
        held += size
        if held >= limits[min(count, 1)]:
            count, held = count + 1, 0
    return count + (held > 0)


@pytest.mark.parametrize("bucket_bytes", [2048, 25 * 2**20])
def test_gpt_dp_launches_at_most_ddp_buckets(bucket_bytes):
    f, _, params, state, data = _gpt("dp", {"bucket_bytes": bucket_bytes})
    low = f.lower(params, state, *data(0))
    grads = [p.numel() * p.element_size() for p in params.values()]
    launches = low.launches()
    gradient_launches = [launch for launch in launches if any(c.shape != () for c in launch)]
    assert len(gradient_launches) <= _ddp_buckets(grads, bucket_bytes)
    assert len(gradient_launches) <= math.ceil(sum(grads) / bucket_bytes)  # one dtype here
    before = sharded(
        f.__wrapped__, mesh=f.mesh, in_specs=f.in_specs, out_specs=f.out_specs, passes=False
    ).lower(params, state, *data(0))
    assert low.cost().comm_bytes_per_rank == before.cost().comm_bytes_per_rank
    assert len(low.collectives()) == before.cost().collective_count  # every tensor still listed


def test_gradient_buckets_are_issued_during_backward_and_waited_late():
    f, _, params, state, data = _gpt("dp", SMALL)
    low = f.lower(params, state, *data(0))
    program = low.program
    nodes = list(program.programs[0].graph.nodes)
    origin = {n.name: n for n in program.traced.module.graph.nodes}

    def backward(n):
        o = origin.get(n.meta.get("shardspec_origin", ""))
        return o is not None and "backward of" in (o.meta.get("stack_trace") or "")

    last_backward = max(i for i, n in enumerate(nodes) if backward(n))
    issued = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.kwargs.get("async_op")]
    assert sum(i < last_backward for i in issued) >= 3  # buckets go out while backward still runs
    for i in issued:  # each waited where its result is first needed, not right away
        (wait,) = nodes[i].users
        assert wait.target is torch.ops.shardspec.wait.default
        assert min(nodes.index(u) for u in wait.users) == nodes.index(wait) + 1


def test_zero3_parameter_gathers_are_bucketed_and_prefetched():
    f, _, params, state, data = _gpt("zero3", {"bucket_bytes": 4096})
    low = f.lower(params, state, *data(0))
    nodes = list(low.program.programs[0].graph.nodes)

    def of_parameters(n):
        inputs = n.all_input_nodes
        return all(x.op == "placeholder" or (x.op == "call_function" and of_parameters(x)) for x in inputs)

    gathers = [n for n in nodes if n.target is torch.ops.shardspec.all_gather.default and of_parameters(n)]
    assert any(len(g.meta.get("shardspec_members", ())) > 1 for g in gathers)
    # gather k + 1 is issued before gather k's result is used: one launch ahead
    for k in range(1, len(gathers)):
        (wait,) = gathers[k - 1].users
        first_use = min(nodes.index(u) for u in wait.users)
        assert nodes.index(gathers[k]) < first_use


def test_uneven_layouts_launch_the_same_sequence_on_every_rank():
    mesh = Mesh({"dp": 3}, simulate=True)
    step = mlp.make_step(OPT)
    params = mlp.init(8, 10, 4)  # 10 over 3: blocks 4, 4, 2
    split = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
    f = sharded(
        step,
        mesh=mesh,
        in_specs=(split, OPT.state_specs(split), P("dp"), P("dp")),
        out_specs=(split, OPT.state_specs(split), P()),
    )
    x, y = torch.randn(12, 8), torch.randint(0, 4, (12,))
    program = f._program((params, OPT.init(params), x, y))[0]
    assert program.programs[0] is not program.programs[1]
    assert len({launch_sequence(p) for p in program.programs}) == 1
    want = step(params, OPT.init(params), x, y)
    _same(f(params, OPT.init(params), x, y), want)


def test_views_replace_copies_and_outputs_stay_dense():
    f, _, params, state, data = _gpt("dp", None)
    on = f.lower(params, state, *data(0)).program.programs[0]
    off_f = sharded(f.__wrapped__, mesh=f.mesh, in_specs=f.in_specs, out_specs=f.out_specs, passes=False)
    off = off_f.lower(params, state, *data(0)).program.programs[0]

    def copies(gm):
        names = [getattr(n.target, "_schema", None) for n in gm.graph.nodes if n.op == "call_function"]
        return sum(s is not None and s.name.endswith("_copy") and s.name != "aten::_to_copy" for s in names)

    # a step without in-place ops is traced without functionalization, so it has no copies to
    # begin with; whatever copies the trace leaves, the pass replaces
    assert copies(on) == 0 and copies(on) <= copies(off)
    got = f(params, state, *data(0))
    assert all(t.is_contiguous() for t in optree.tree_leaves(got))


def test_each_pass_is_pure_and_switchable():
    f, _, params, state, data = _gpt("dp", ("views",))
    gm = f.lower(params, state, *data(0)).program.programs[0]
    assert not any(n.target is torch.ops.shardspec.wait.default for n in gm.graph.nodes)
    code = gm.code
    for fn in (
        cp.views,
        cp.regather,
        cp.inplace,
        cp.overlap,
        cp.dense_results,
        lambda g: cp.bucketing(g, 256),
        lambda g: cp.remat(g, {}),
        lambda g: cp.cast(g, torch.bfloat16),
    ):
        assert fn(gm) is not gm
        assert gm.code == code
    assert cp.options(None) == cp.PassOptions()
    assert cp.options(["bucket"]) == cp.PassOptions(
        views=False, remat=False, regather=False, cast=False, bucket=True, inplace=False, overlap=False
    )
    assert cp.options({"overlap": False}).bucket
    with pytest.raises(ShardingError, match="names no pass option"):
        sharded(
            lambda x: x, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P(),), out_specs=P(), passes=["fuse"]
        )
    assert cp.options({"bucket", "overlap"}) == cp.options(["bucket", "overlap"])  # a set of names too
    # reduce_dtype is carried out by the cast pass: with it off the option was silently ignored
    with pytest.raises(ShardingError, match="sets reduce_dtype with the cast pass off"):
        cp.options({"reduce_dtype": torch.bfloat16, "cast": False})
    for bad in (1.5, float("inf"), -1, "8GB"):  # 1.5 ran as a budget of 1 byte
        with pytest.raises(ShardingError, match="is not a positive number of bytes per rank"):
            sharded(
                lambda x: x,
                mesh=Mesh({"dp": 2}, simulate=True),
                in_specs=(P(),),
                out_specs=P(),
                memory_budget=bad,
            )


def test_explain_lists_each_launch_with_the_tensors_in_it():
    f, _, params, state, data = _gpt("dp", None)
    low = f.lower(params, state, *data(0))
    text = low.explain()
    members = re.findall(r"^  \[(\d+)\] ", text, re.M)  # one line per tensor, numbered by its launch
    assert len(set(members)) == low.cost().collective_count and len(members) == len(low.collectives())
    assert max(members.count(m) for m in members) > 1  # a bucket: one launch of several tensors


def test_norm_kernels_get_dense_operands_from_views_and_buckets():
    """Group norm reads its weight as dense memory: a bucketed gather's strided slice gave a wrong
    answer, a view of a softmax over dim 0 an internal error; both now match with the passes on."""
    import torch.nn.functional as F

    def a(x, w, b):
        return F.group_norm((1.0 - x) * 2, 1, w, b)

    def b(x, w, b):
        return F.group_norm(torch.softmax(x, 0) * 2, 1, w, b)

    g = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((2, 2), (2,), (2,)))
    mesh = Mesh({"dp": 2}, simulate=True)
    for fn, in_specs in ((a, (P(), P("dp"), P("dp"))), (b, (P(None, "dp"), P(), P("dp")))):
        step = sharded(fn, mesh=mesh, in_specs=in_specs, out_specs=P())
        torch.testing.assert_close(step(x, w, bias), fn(x, w, bias))


def test_bucketing_packs_values_unpacked_from_an_earlier_bucket():
    """Megatron weights with the batch over dp, gradients returned replicated: a gather bucket
    packs values an earlier bucket's split_with_sizes unpacked. Their getitems had no fake value
    (the split's value is a list), and packing crashed (AttributeError)."""
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 16, generator=g), "w2": torch.randn(16, 8, generator=g)}
    x = torch.randn(8, 8, generator=g)

    def loss_fn(p, x):
        return ((x @ p["w1"]) @ p["w2"]).pow(2).sum()

    step = sharded(
        shardspec.value_and_grad(loss_fn),
        mesh=mesh,
        in_specs=({"w1": P(None, "tp"), "w2": P("tp", None)}, P("dp")),
        out_specs=P(),
    )
    want = shardspec.value_and_grad(loss_fn)(params, x)
    for a, b in zip(optree.tree_leaves(step(params, x)), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # split sums round differently
    two = sharded(
        lambda a, b: (a @ b, a @ b),
        mesh=mesh,
        in_specs=(P("dp", "tp"), P("tp")),
        out_specs=(P(None, "tp"),) * 2,
    )
    a, b = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    for got in two(a, b):
        torch.testing.assert_close(got, a @ b)


def test_layer_norm_weight_and_bias_gradients_come_from_the_fused_kernel():
    """``norm_grads``: on each rank the weight and bias gradient sums the trace writes go back into
    ``native_layer_norm_backward`` (its sub and two muls are gone), with the batch split or not and
    the results equal; with ``views`` off the sums stay."""
    import torch.nn.functional as F

    aten = torch.ops.aten

    def loss(p, x):
        h = F.layer_norm(x @ p["m"], (8,), p["w"], p["b"])  # its input's gradient is asked for too
        return (h * h.flip(-1)).sum()

    def step(p, x):
        return shardspec.value_and_grad(loss)(p, x)

    g = torch.Generator().manual_seed(0)
    p = {
        "w": torch.randn(8, generator=g),
        "b": torch.randn(8, generator=g),
        "m": torch.randn(8, 8, generator=g),
    }
    x = torch.randn(4, 3, 8, generator=g)
    want = step(p, x)
    for n in (1, 2):
        counts = {}
        for views in (True, False):
            f = sharded(
                step,
                mesh=Mesh({"dp": n}, simulate=True),
                in_specs=(P(), P("dp")),
                out_specs=(P(), P()),
                passes={"views": views},
            )
            gm = f.lower(p, x).program.programs[0]
            (kernel,) = [n for n in gm.graph.nodes if n.target is aten.native_layer_norm_backward.default]
            assert list(kernel.args[7]) == ([True, True, True] if views else [True, False, False])
            counts[views] = sum(n.target in (aten.sub.Tensor, aten.mul.Tensor) for n in gm.graph.nodes)
            got = f(p, x)
            torch.testing.assert_close(got[0], want[0])
            for k in p:
                torch.testing.assert_close(got[1][k], want[1][k])
        assert counts[False] - counts[True] == 3
