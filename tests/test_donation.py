"""Donation (``sharded(..., donate=...)``, as ``jax.jit(donate_argnums=...)``): results written into
the donated inputs' buffers, the same values as without, a donated tensor refused when passed
again, and on gloo the returned DTensors reuse the donated local storage."""

from __future__ import annotations

import optree
import pytest
import torch

from examples.models import mlp
from shardspec import Mesh, P, ShardingError, optim, sharded
from tests.mlp_strategies import batch, specs

OPT = optim.adamw(lr=1e-2, weight_decay=0.1)
STEP = mlp.make_step(OPT)


def _step(strategy, donate, mesh=None):
    axes, pspec, sspec, bspec = specs(strategy, OPT)
    return sharded(
        STEP,
        mesh=mesh or Mesh(axes, simulate=True),
        in_specs=(pspec, sspec, bspec, bspec),
        out_specs=(pspec, sspec, P()),
        donate=donate,
    )


@pytest.mark.parametrize("strategy", ["dp", "zero3", "megatron"])
def test_donated_step_computes_the_same_and_writes_into_the_inputs(strategy):
    params = mlp.init(8, 16, 4)
    got_p, got_s = params, OPT.init(params)
    want_p, want_s = params, OPT.init(params)
    f = _step(strategy, (0, 1))
    for i in range(3):
        got_p, got_s, _ = f(got_p, got_s, *batch(i))
        want_p, want_s, _ = STEP(want_p, want_s, *batch(i))
        got, want = optree.tree_leaves((got_p, got_s)), optree.tree_leaves((want_p, want_s))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    program = f.lower(got_p, got_s, *batch(0)).program
    gm = program.programs[0]
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]

    def buffer(n):  # the input buffer a result lives in: copied into, or updated in place
        while n.target in (torch.ops.aten.contiguous.default, torch.ops.aten.copy_.default):
            n = n.args[0]
        return n

    landed = {program.traced.in_paths[holders.index(buffer(r))] for r in out.args[0] if buffer(r) in holders}
    # every parameter, both moments and the step count land in a donated buffer
    assert landed == set(program.traced.in_paths[:10])
    # parameters and moments by one fused update where they lie (no fresh buffers, no copy back)
    (update,) = [n for n in gm.graph.nodes if n.target is torch.ops.shardspec.adamw_multi_.default]
    assert {holders.index(a) for a in (*update.args[0], *update.args[2], *update.args[3])} == {
        i for i in range(10) if i != 6
    }  # (input 6 is the step count, copied)


def test_donation_lowers_the_memory_held_at_the_end_of_the_step():
    params = mlp.init(64, 256, 64)
    state = OPT.init(params)
    x, y = torch.randn(16, 64), torch.randint(0, 64, (16,))
    plain = _step("dp", ()).lower(params, state, x, y).cost()
    donated = _step("dp", (0, 1)).lower(params, state, x, y).cost()
    model_state = 3 * sum(p.numel() for p in params.values()) * 4  # params, m, v (replicated)
    # new parameters and moments no longer sit beside the old ones (one temporary at a time)
    assert donated.peak_memory_bytes_per_rank <= plain.peak_memory_bytes_per_rank - model_state // 2


def test_a_donated_argument_passed_again_is_an_error_naming_it():
    params = mlp.init(8, 16, 4)
    state = OPT.init(params)
    f = _step("dp", (0,))
    new_params, state, _ = f(params, state, *batch(0))
    with pytest.raises(ShardingError, match=r"(?s)params\['b1'\] was donated .*pass the value that call"):
        f(params, state, *batch(1))
    f(new_params, state, *batch(1))  # the returned value is fine
    undonated = _step("dp", ())
    with pytest.raises(ShardingError, match="was donated"):
        undonated(params, state, *batch(1))  # any step: the buffer is gone


def test_donating_an_argument_returned_unchanged_is_an_error():
    mesh = Mesh({"dp": 2}, simulate=True)

    def step(params, x):
        return params, (x * params["w"]).sum()

    f = sharded(step, mesh=mesh, in_specs=(P(), P("dp")), out_specs=(P(), P()), donate=(0,))
    with pytest.raises(ShardingError, match=r"params\['w'\] is donated .* returns it unchanged"):
        f({"w": torch.ones(4)}, torch.ones(4, 4))


@pytest.mark.parametrize("spec", [P(), P("dp")])
def test_donating_an_argument_returned_through_constrain_is_the_same_error(spec):
    from shardspec import constrain

    def step(a, b):
        return a * 2, constrain(b, spec), b / 3

    f = sharded(
        step,
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(P(), spec),
        out_specs=(P(), P(), P()),
        donate=(1,),
    )
    with pytest.raises(ShardingError, match=r"b is donated .* returns it unchanged"):
        f(torch.randn(6), torch.randn(6))


@pytest.mark.parametrize("bad", ["params", (0, -1), (True,)])
def test_donate_takes_argument_positions(bad):
    with pytest.raises(ShardingError, match="not a tuple of argument positions"):
        _step("dp", bad)


def _donate_on_gloo(rank: int, world: int) -> dict[str, object]:
    mesh = Mesh(specs("zero3", OPT)[0])
    f = _step("zero3", (0, 1), mesh=mesh)
    params = mlp.init(8, 16, 4)
    state = OPT.init(params)
    params, state, _ = f(params, state, *batch(0))  # DTensors from here on
    # each block owns storage of its own size: a block that is a view of the full tensor passed in
    # would keep the whole tensor alive on every rank (N times the ZeRO memory)
    blocks = [t.to_local() for t in optree.tree_leaves((params, state))]
    oversized = [
        tuple(b.shape) for b in blocks if b.untyped_storage().nbytes() > b.numel() * b.element_size()
    ]
    before = params["w1"].to_local().data_ptr()
    new, state, _ = f(params, state, *batch(1))
    try:
        f(params, state, *batch(2))
        refused = ""
    except ShardingError as exc:
        refused = str(exc)
    want_p, want_s = mlp.init(8, 16, 4), OPT.init(mlp.init(8, 16, 4))
    for i in range(2):
        want_p, want_s, _ = STEP(want_p, want_s, *batch(i))
    return {
        "reused": new["w1"].to_local().data_ptr() == before,
        "oversized": oversized,
        "refused": refused,
        "close": all(torch.allclose(new[k].full_tensor(), want_p[k], atol=1e-6) for k in want_p),
    }


@pytest.mark.multiprocess
def test_real_mesh_results_reuse_the_donated_local_storage_of_their_own_size():
    from shardspec.testing import run_distributed

    for r in run_distributed(_donate_on_gloo, 4, timeout=120):
        assert r["reused"] and r["close"] and r["oversized"] == []
        assert "was donated" in r["refused"]


def _results_own_their_storage_on_gloo(rank: int, world: int) -> dict[str, object]:
    import shardspec

    mesh = Mesh({"dp": world})
    out: dict[str, object] = {}
    for name, spec in (("rep", P()), ("split", P("dp"))):
        place = sharded(lambda p: p, mesh=mesh, in_specs=(P(),), out_specs=spec)

        def train_step(p, x):
            loss, g = shardspec.value_and_grad(lambda p, x: ((x @ p) ** 2).mean())(p, x)
            new = p - 0.1 * g
            return new, new, loss

        train = sharded(
            train_step, mesh=mesh, in_specs=(spec, P("dp")), out_specs=(spec, spec, P()), donate=(0,)
        )
        init = torch.arange(12.0).reshape(4, 3) / 10
        saved = init.clone()
        p = place(init)  # the caller's tensor laid out: not a view of it
        p, snapshot, _ = train(p, torch.ones(6, 4))
        kept = snapshot.full_tensor().clone()
        train(p, torch.ones(6, 4))  # donates p: the snapshot returned beside it must not change
        out[name] = (torch.equal(init, saved), torch.equal(snapshot.full_tensor(), kept))
    return out


@pytest.mark.multiprocess
def test_real_mesh_results_never_share_storage_with_the_caller_or_each_other():
    """A simulated mesh returns copies; a real one returned the caller's own (not donated) tensor
    for a pass-through result, and one buffer for a value returned twice, so a later donation of
    one result overwrote the caller's parameters or the other result."""
    from shardspec.testing import run_distributed

    for r in run_distributed(_results_own_their_storage_on_gloo, 2, timeout=120):
        assert r == {"rep": (True, True), "split": (True, True)}


def test_donation_on_uneven_blocks_keeps_global_shapes():
    """5 rows over 3 devices are blocks of 2, 2, 1: donation used to rebuild 6 rows from them."""
    opt = optim.adamw(lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    params = mlp.init(8, 5, 5)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)
    pspec = {"w1": P("a"), "b1": P(), "w2": P("a")}
    sspec = opt.state_specs(pspec)
    step = sharded(
        mlp.make_step(opt),
        mesh=Mesh({"a": 3}, simulate=True),
        in_specs=(pspec, sspec, P(None, "a"), P()),
        out_specs=(pspec, sspec, P()),
        donate=(0, 1),
    )
    ref = mlp.make_step(opt)
    got, want = (params, opt.init(params)), (params, opt.init(params))
    for _ in range(2):
        got = step(*got, x, y)[:2]
        want = ref(*want, x, y)[:2]
    for k in params:
        torch.testing.assert_close(got[0][k], want[0][k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=["replicated", "zero"])
def test_donated_adamw_runs_in_place_with_torch_fused_adamw_bits(spec):
    """Donated parameters and moments are updated where they lie by one multi-tensor node that
    runs torch's fused AdamW kernel: the same bits as torch.optim.AdamW(fused=True), and within
    rounding of the default per-parameter loop (which the undonated step matches exactly)."""
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    params = {"w": torch.randn(8, 5, generator=g), "b": torch.randn(8, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(3)]
    specs_ = {k: spec for k in params}

    def update(p, s, gr):
        return opt.update(gr, s, p)

    step = sharded(
        update,
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(specs_, opt.state_specs(specs_), specs_),
        out_specs=(specs_, opt.state_specs(specs_)),
        donate=(0, 1),
    )
    program = step.lower(params, opt.init(params), grads[0]).program
    targets = [n.target for n in program.programs[0].graph.nodes]
    assert targets.count(torch.ops.shardspec.adamw_multi_.default) == 1
    assert torch.ops.shardspec.adamw.default not in targets
    fused = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    loop = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    torch_fused = torch.optim.AdamW(list(fused.values()), lr=1e-2, weight_decay=0.1, fused=True)
    torch_loop = torch.optim.AdamW(list(loop.values()), lr=1e-2, weight_decay=0.1)
    p, s = {k: v.clone() for k, v in params.items()}, opt.init(params)
    for gr in grads:
        p, s = step(p, s, gr)
        for refs, o in ((fused, torch_fused), (loop, torch_loop)):
            for k, r in refs.items():
                r.grad = gr[k].clone()
            o.step()
    for k in params:
        torch.testing.assert_close(p[k], fused[k].detach(), rtol=0, atol=0)
        torch.testing.assert_close(s["m"][k], torch_fused.state[fused[k]]["exp_avg"], rtol=0, atol=0)
        torch.testing.assert_close(p[k], loop[k].detach(), rtol=1e-6, atol=1e-7)


def test_zero1_donation_keeps_a_replicated_parameter_functional_and_correct():
    """ZeRO-1 (parameters replicated, moments split): the update reads a slice of the parameter,
    which is not the donated buffer itself, so those updates stay functional (results copied in)."""
    rep = {"w1": P(), "b1": P(), "w2": P()}
    split = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
    f = sharded(
        STEP,
        mesh=Mesh({"dp": 4}, simulate=True),
        in_specs=(rep, OPT.state_specs(split), P("dp"), P("dp")),
        out_specs=(rep, OPT.state_specs(split), P()),
        donate=(0, 1),
    )
    params = mlp.init(8, 16, 4)
    got, want = (params, OPT.init(params)), (params, OPT.init(params))
    for i in range(2):
        got = f(*got, *batch(i))[:2]
        want = STEP(*want, *batch(i))[:2]
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_donation_with_a_result_whose_blocks_differ_by_rank_computes_the_same():
    """A replicated donated input and a result split unevenly (blocks 2 and 1, or 1, 1 and 0): a
    program shared by all ranks is sized by rank 0's blocks, so donation once wrote rank 0's
    block shape on every rank (a 1-element block broadcast into a 2-element buffer)."""
    cases = [(3, 5, 2), (2, 3, 2), (2, 5, 3), (4, 7, 2), (1, 2, 3)]
    for n_in, n_out, devices in cases:

        def fn(x, n_out=n_out):
            return torch.cat([0.5 - x * 2, x * 3])[:n_out]

        f = sharded(
            fn, mesh=Mesh({"dp": devices}, simulate=True), in_specs=(P(),), out_specs=P("dp"), donate=(0,)
        )
        x = torch.randn(n_in)
        want = fn(x)
        got = f(x.clone())
        assert got.shape == want.shape, (n_in, n_out, devices)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("as_dict", [False, True])
def test_one_result_returned_twice_with_both_inputs_donated(as_dict):
    """The second slot of a result returned twice pointed at the first slot's copy into the
    donated buffer, a node the pass had not placed: KeyError. Both slots now hold that buffer."""

    def fn(a, b):
        c = a * 2 + b
        return {"x": c, "y": c} if as_dict else (c, c)

    specs = {"x": P("dp"), "y": P("dp")} if as_dict else (P("dp"), P("dp"))
    f = sharded(
        fn, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"), P("dp")), out_specs=specs, donate=(0, 1)
    )
    a, b = torch.arange(8.0), torch.arange(8.0) * 10
    want = fn(a.clone(), b.clone())
    for got, expected in zip(optree.tree_leaves(f(a, b)), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(got, expected)
