"""Pipelined steps on simulated meshes equal the unpipelined step (parameters, AdamW state, loss);
P2P bytes follow 2 * m * cut bytes; stages own their parameters; bad input is a clear error."""

import math
import re

import optree
import pytest
import torch

import shardspec
from benchmarks import pipeline_model as pm
from collectives.accounting import count_bytes
from compiler.pipeline.boundary import BOUNDARY
from compiler.pipeline.timeline import recording
from compiler.plan.report import modeled_seconds
from shardspec import Mesh, P, Pipeline, ShardingError, local_shape, optim, sharded

OPT = optim.adamw(lr=1e-2, weight_decay=0.1)
D, HIDDEN, CLASSES, BATCH = 8, 16, 4, 16


def _setup(layers=4, microbatches=4, batch=BATCH):
    params = pm.init(layers, D, HIDDEN, CLASSES)
    x, y = pm.data(batch, D, CLASSES)
    return params, OPT.init(params), x, y, pm.make_step(microbatches, OPT)


def _close(got, want):
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _compiled(step, params, shape, pipeline, **kw):
    mesh = Mesh(shape, simulate=True)
    ps, ss, xs, ys = pm.specs(params, "tp" in shape, "dp" in shape, OPT)
    return sharded(
        step, mesh=mesh, in_specs=(ps, ss, xs, ys), out_specs=(ps, ss, P()), pipeline=pipeline, **kw
    )


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_pipelined_step_equals_unpipelined_pp_dp_tp(schedule, v):
    params, state, x, y, step = _setup()
    run = _compiled(step, params, {"pp": 2, "dp": 2, "tp": 2}, Pipeline("pp", schedule, v))
    want = step(params, state, x, y)
    got = run(params, state, x, y)
    _close(got, want)
    _close(run(*got[:2], x, y), step(*want[:2], x, y))  # a second step from the pipelined results


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_pipelined_step_equals_unpipelined_pp4(schedule):
    params, state, x, y, step = _setup(layers=4, microbatches=8)
    run = _compiled(step, params, {"pp": 4}, Pipeline("pp", schedule))
    _close(run(params, state, x, y), step(params, state, x, y))


def test_without_pipeline_boundaries_vanish():
    params, state, x, y, step = _setup()
    run = _compiled(step, params, {"dp": 2}, None)
    _close(run(params, state, x, y), step(params, state, x, y))
    assert "pipeline_boundary" not in run.lower(params, state, x, y).as_text()


def _cut_bytes(lowered, mesh):
    """Bytes of one microbatch's activation at each stage cut, on one rank, as propagation laid it out."""
    prog = lowered.program
    cuts = set(prog.pipeline.stages.cuts)
    out = []
    for n in prog.traced.module.graph.nodes:
        custom = n.meta.get("custom") or {}
        first = custom.get("shardspec_microbatch") == 0
        if n.target is BOUNDARY and not n.kwargs["backward"] and first and n.kwargs["cut"] in cuts:
            src = n.args[0]
            shape = local_shape(tuple(src.meta["val"].shape), mesh, prog.prop.value[src].spec, 0)
            out.append(math.prod(shape) * src.meta["val"].element_size())
    return out


def test_p2p_bytes_are_2_m_cut_bytes_and_dp_bytes_unchanged():
    m, layers = 4, 4
    shape = {"pp": 4, "dp": 2}
    params, state, x, y, step = _setup(layers, m, 64)
    run = _compiled(step, params, shape, Pipeline("pp", "1f1b"))
    flat = _compiled(step, params, {"dp": 2}, None, passes=False)
    with count_bytes() as piped:
        run(params, state, x, y)
    with count_bytes() as plain:
        flat(params, state, x, y)
    mesh = Mesh(shape, simulate=True)
    lowered = run.lower(params, state, x, y)
    cuts = _cut_bytes(lowered, mesh)
    assert len(cuts) == layers - 1
    sent = sum(r.bytes_per_rank for r in piped.records if r.kind == "send")
    assert sent == 2 * m * sum(cuts) * 2  # forward and backward, per cut, in each of the 2 pp groups
    planned = [c for c in lowered.collectives() if c.kind == "send"]
    assert sum(c.bytes_per_rank for c in planned) == 2 * m * sum(cuts)
    by_position = [
        sum(t.bytes for t in lowered.program.pipeline.per_rank[0].p2p if t.src == q) for q in range(4)
    ]
    assert lowered.cost().bytes_by_kind["send"] == max(by_position)

    # the other collectives: each stage moves its own part of what the unpipelined step moves
    def moved(counter, ranks):
        return sum(r.bytes_by_rank.get(k, 0) for r in counter.records if r.kind != "send" for k in ranks)

    stage_ranks = [mesh.rank_of({"pp": s, "dp": 0}) for s in range(4)]
    assert moved(piped, stage_ranks) == pytest.approx(moved(plain, [0]))


def test_each_stage_holds_only_its_parameters():
    """No rank reads (so none is given) another stage's parameters or optimizer moments."""
    params, state, x, y, step = _setup()
    shape = {"pp": 2, "dp": 2}
    lowered = _compiled(step, params, shape, Pipeline("pp", "1f1b")).lower(params, state, x, y)
    paths = lowered.program.traced.in_paths
    mesh = Mesh(shape, simulate=True)
    for rank, sp in enumerate(lowered.program.pipeline.per_rank):
        stage = mesh.axis_index(rank, "pp")
        held = [paths[i] for i in sp.reads]
        blocks = {int(b) for h in held for b in re.findall(r"\['blocks'\]\[(\d+)\]", h)}
        assert blocks == {2 * stage, 2 * stage + 1}, held
        assert any("['v']['blocks']" in h for h in held) and any("['m']['blocks']" in h for h in held)
        assert any("head" in h for h in held) == (stage == 1)
        assert any(h.startswith("y") for h in held) == (stage == 1)
        assert any(h.startswith("x") for h in held) == (stage == 0)


def test_explain_shows_balanced_stages():
    params, state, x, y, step = _setup(layers=6)
    run = _compiled(step, params, {"pp": 3}, Pipeline("pp", "1f1b"))
    lowered = run.lower(params, state, x, y)
    stages = lowered.program.pipeline.stages
    assert stages.stages == 3 and len(stages.segment_cost) == 6
    assert stages.balance < 1.2
    text = lowered.explain()
    assert "stage 0" in text and "balance" in text


def _step_with(microbatches, boundaries=True):
    def loss_fn(params, x, y):
        return torch.nn.functional.cross_entropy(pm.forward(params, x, boundaries), y)

    def step(params, x, y):
        loss, grads = shardspec.value_and_grad(loss_fn, microbatches=microbatches)(params, x, y)
        return loss, grads

    return step


def _run_error(step, shape, pipeline, layers=2, batch=BATCH):
    params = pm.init(layers, D, HIDDEN, CLASSES)
    x, y = pm.data(batch, D, CLASSES)
    run = sharded(
        step, mesh=Mesh(shape, simulate=True), in_specs=(P(), P(), P()), out_specs=P(), pipeline=pipeline
    )
    return run(params, x, y)


def test_error_too_few_boundaries():
    with pytest.raises(ShardingError, match=r"(?s)needs 4 stages.*1 pipeline_boundary.*Fix:.*at least 3"):
        _run_error(_step_with(2), {"pp": 4}, Pipeline("pp", "1f1b"))


def test_error_microbatches_do_not_divide_the_batch():
    with pytest.raises(ShardingError, match=r"shape \(15, 8\).*4 microbatches"):
        _run_error(_step_with(4), {"pp": 2}, Pipeline("pp", "1f1b"), batch=15)


def test_error_stage_without_work():
    def loss_fn(params, x, y):
        h = shardspec.pipeline_boundary(shardspec.pipeline_boundary(x))
        return torch.nn.functional.cross_entropy(pm.forward(params, h, False), y)

    def step(params, x, y):
        return shardspec.value_and_grad(loss_fn, microbatches=2)(params, x, y)

    with pytest.raises(ShardingError, match=r"(?s)stage 0 has no work.*Fix:"):
        _run_error(step, {"pp": 3}, Pipeline("pp", "gpipe"))


def test_error_pipeline_axis_missing():
    with pytest.raises(ShardingError, match=r"axis='pp'.*not an axis of the mesh dp=2"):
        _run_error(_step_with(2), {"dp": 2}, Pipeline("pp", "1f1b"))


def test_error_virtual_stages_without_interleaving():
    with pytest.raises(ShardingError, match=r"(?s)only the interleaved schedule.*Fix:"):
        Pipeline("pp", "1f1b", virtual_stages=2)
    with pytest.raises(ShardingError, match=r"at least\s+2 stages per rank"):
        Pipeline("pp", "interleaved", virtual_stages=1)


def test_error_spec_over_the_pipeline_axis():
    params = pm.init(2, D, HIDDEN, CLASSES)
    x, y = pm.data(BATCH, D, CLASSES)
    run = sharded(
        _step_with(2),
        mesh=Mesh({"pp": 2}, simulate=True),
        in_specs=(P(), P("pp"), P()),
        out_specs=P(),
        pipeline=Pipeline("pp", "1f1b"),
    )
    with pytest.raises(ShardingError, match=r"x has spec P\('pp'\).*pipeline axis"):
        run(params, x, y)


@pytest.mark.parametrize("zero", ["zero1", "zero3"])
def test_zero_inside_stages(zero):
    """ZeRO over dp inside each stage: moments (ZeRO-1) or parameters too (ZeRO-3) split over dp."""
    params, state, x, y, step = _setup()
    split = optree.tree_map(lambda _: P("dp"), params)
    pspec = split if zero == "zero3" else optree.tree_map(lambda _: P(), params)
    run = sharded(
        step,
        mesh=Mesh({"pp": 2, "dp": 2}, simulate=True),
        in_specs=(pspec, OPT.state_specs(split), P("dp"), P("dp")),
        out_specs=(pspec, OPT.state_specs(split), P()),
        pipeline=Pipeline("pp", "1f1b"),
    )
    want = step(params, state, x, y)
    got = run(params, state, x, y)
    _close(got, want)
    _close(run(*got[:2], x, y), step(*want[:2], x, y))


def test_timeline_follows_the_action_lists_and_draws():
    params, state, x, y, step = _setup()
    run = _compiled(step, params, {"pp": 2}, Pipeline("pp", "zb-h1"))
    run(params, state, x, y)
    with recording() as spans:
        run(params, state, x, y)
    sched = run.lower(params, state, x, y).pipeline_schedule()
    for r in range(2):
        assert [a for a, _, _ in spans[r]] == [str(a) for a in sched.lists[r]]
        assert all(s <= e for _, s, e in spans[r])
    ends = {a: e for r in spans for a, _, e in spans[r]}
    starts = {a: s for r in spans for a, s, _ in spans[r]}
    for k in range(4):  # a microbatch's activation reaches stage 1 only after stage 0 made it
        assert ends[f"F0.{k}"] <= starts[f"F1.{k}"]
        assert ends[f"B1.{k}"] <= starts[f"W0.{k}"]  # stage 0 has no input gradient: W reads it
    assert sched.svg().startswith("<svg") and ">F0.0<" in sched.svg()
    assert sched.svg(measured=spans).count("<rect") == sum(len(v) for v in spans.values())
    assert max(sched.peak_in_flight) <= 2


def test_error_two_gradient_calls_in_one_pipelined_step():
    def loss_fn(params, x, y):
        return torch.nn.functional.cross_entropy(pm.forward(params, x), y)

    def step(params, x, y):
        loss, _ = shardspec.value_and_grad(loss_fn, microbatches=2)(params, x, y)
        loss2, _ = shardspec.value_and_grad(loss_fn, microbatches=2)(params, x, y)
        return loss + loss2

    with pytest.raises(
        ShardingError, match=r"(?s)calls shardspec.value_and_grad 2 times.*Fix: .*one value_and_grad"
    ):
        _run_error(step, {"pp": 2}, Pipeline("pp", "1f1b"))


def test_explain_and_cost_count_the_sends():
    """explain(), cost() and launches() see the P2P sends: the busiest position's launches, bytes
    and modeled time; every send names the user's pipeline_boundary line."""
    params, state, x, y, step = _setup(layers=4)
    shape = {"pp": 4, "dp": 2}
    lowered = _compiled(step, params, shape, Pipeline("pp", "1f1b")).lower(params, state, x, y)
    mesh = Mesh(shape, simulate=True)
    p2p = lowered.program.pipeline.per_rank[0].p2p
    sends = [[t for t in p2p if t.src == q] for q in range(4)]
    busiest = max(range(4), key=lambda q: sum(t.bytes for t in sends[q]))
    others = [ln for ln in lowered.launches(0) if ln[0].kind != "send"]
    cost = lowered.cost()
    assert cost.collective_count == len(others) + len(sends[busiest])
    assert cost.bytes_by_kind["send"] == sum(t.bytes for t in sends[busiest])
    without_sends, _ = modeled_seconds(
        lowered.program, ((ln[0].kind, ln[0].axes, lowered._launch_bytes(ln)) for ln in others)
    )
    assert cost.modeled_comm_s > without_sends  # the sends take modeled time too
    for q in range(4):
        rank = mesh.rank_of({"pp": q, "dp": 0})
        mine = [ln[0] for ln in lowered.launches(rank) if ln[0].kind == "send"]
        assert len(mine) == len(sends[q]) and all(c.axes == ("pp",) for c in mine)
    records = [c for c in lowered.collectives() if c.kind == "send"]
    assert records and all("pipeline_boundary" in c.source for c in records)
    text = lowered.explain()
    assert "no communication" not in text
    assert f"{cost.collective_count} collective launch(es)" in text.splitlines()[0]
    assert re.search(rf"send over pp: {len(p2p)} launch\(es\)", text)
    assert "pipeline_boundary" in text


def test_error_boundary_outside_value_and_grad_names_that_boundary():
    def step(params, x, y):
        x = shardspec.pipeline_boundary(x)  # misplaced: in the step, not in the loss
        return _step_with(2)(params, x, y)

    line = step.__code__.co_firstlineno + 1
    with pytest.raises(
        ShardingError, match=rf"(?s)pipeline_boundary at \S*test_pipeline.py:{line}:.*outside"
    ) as e:
        _run_error(step, {"pp": 2}, Pipeline("pp", "1f1b"))
    assert "microbatches=2" in str(e.value) and "Fix: move that pipeline_boundary" in str(e.value)


@pytest.mark.parametrize(
    ("pp", "v", "fix"),
    [
        (4, 2, r"lower virtual_stages from 2 to 1 with a non-interleaved schedule"),
        (2, 4, r"virtual_stages=2\)"),
    ],
)
def test_error_too_few_boundaries_interleaved_suggests_fewer_virtual_stages(pp, v, fix):
    """3 boundaries make 4 stages: pp=4 x v=2 needs 8 (no interleaving fits), pp=2 x v=4 needs 8
    (v=2 fits)."""
    with pytest.raises(ShardingError, match=rf"(?s)needs {pp * v} stages.*3 pipeline_boundary.*Fix:.*{fix}"):
        _run_error(_step_with(4), {"pp": pp}, Pipeline("pp", "interleaved", v), layers=4)


def _masked_loss(p, x, mask):  # x: (B, 4) a batch; mask: (4, 4) the same for every example
    h = shardspec.pipeline_boundary(torch.tanh(x @ (p["w0"] * mask.mean(0))))
    return ((h @ p["w1"]) ** 2).mean()


def test_batch_argnums_keeps_a_non_batch_argument_whole():
    """With batch_argnums naming only the batch, microbatches (eager and pipelined on pp=2) give the
    loss and gradients of one whole-batch call; by default the (4, 4) mask is split too."""
    g = torch.Generator().manual_seed(0)
    p = {"w0": torch.randn(4, 4, generator=g), "w1": torch.randn(4, 2, generator=g)}
    x, mask = torch.randn(8, 4, generator=g), torch.tril(torch.ones(4, 4))
    want = shardspec.value_and_grad(_masked_loss)(p, x, mask)
    whole = shardspec.value_and_grad(_masked_loss, microbatches=2, batch_argnums=1)
    _close(whole(p, x, mask), want)
    split = shardspec.value_and_grad(_masked_loss, microbatches=2)(p, x, mask)  # today's default
    assert not torch.allclose(split[0], want[0])
    run = sharded(
        whole,
        mesh=Mesh({"pp": 2}, simulate=True),
        in_specs=(P(), P(), P()),
        out_specs=P(),
        pipeline=Pipeline("pp", "1f1b"),
    )
    _close(run(p, x, mask), want)
    with pytest.raises(ShardingError, match=r"argument\(s\) \[0\] are both differentiated"):
        shardspec.value_and_grad(_masked_loss, microbatches=2, batch_argnums=(0, 1))
    with pytest.raises(ShardingError, match=r"names argument\(s\) \[5\].*called with 3"):
        shardspec.value_and_grad(_masked_loss, microbatches=2, batch_argnums=5)(p, x, mask)
    from_end = shardspec.value_and_grad(_masked_loss, microbatches=2, batch_argnums=-2)
    _close(from_end(p, x, mask), want)  # counted from the end, as argnums may be
    with pytest.raises(ShardingError, match=r"names argument\(s\) \[-4\].*called with 3"):
        shardspec.value_and_grad(_masked_loss, microbatches=2, batch_argnums=-4)(p, x, mask)
    with pytest.raises(ShardingError, match=r"argument\(s\) \[0\] are both differentiated"):
        shardspec.value_and_grad(_masked_loss, microbatches=2, batch_argnums=(-3, -2))(p, x, mask)
    # nothing left to split (every argument differentiated): m runs on the whole batch, refused
    every = shardspec.value_and_grad(_masked_loss, argnums=(0, 1, 2), microbatches=2)
    with pytest.raises(ShardingError, match=r"no argument is left to split.*all 3 are differentiated"):
        every(p, x, mask)
    assert len(shardspec.value_and_grad(_masked_loss, argnums=(0, 1, 2))(p, x, mask)[1]) == 3


def test_error_constrain_over_the_pipeline_axis_names_the_constrain():
    """Was a 60 s collective timeout: the layout a pipeline position cannot compute is refused
    when compiling, at the user's constrain line."""

    def loss_fn(p, x, y):
        h = shardspec.constrain(torch.tanh(x @ p["w0"]), P("pp", None))
        h = shardspec.pipeline_boundary(h)
        return torch.nn.functional.cross_entropy(h @ p["w1"], y)

    p = {"w0": torch.randn(8, 16), "w1": torch.randn(16, 4)}
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    run = _pp2_gradients(loss_fn)
    with pytest.raises(
        ShardingError, match=r"constrain\(\.\.\., P\('pp'\)\) at .*splits over the pipeline axis 'pp'"
    ):
        run(p, x, y)


@pytest.mark.parametrize(
    ("shape", "hidden", "batch", "zero3"),
    [({"pp": 2, "dp": 2}, 16, 6, False), ({"pp": 2, "tp": 4}, 6, 8, False), ({"pp": 2, "dp": 4}, 6, 8, True)],
)
def test_uneven_blocks_pipeline(shape, hidden, batch, zero3):
    """A batch, a Megatron hidden dim or ZeRO-3 rows split unevenly: each rank's stage program
    is shaped by its own block (it was block 0's, so a shorter rank's matmul did not propagate)."""
    params = pm.init(2, D, hidden, CLASSES)
    x, y = pm.data(batch, D, CLASSES)
    if zero3:
        ps = optree.tree_map(lambda _: P("dp"), params)
    else:
        ps = pm.specs(params, "tp" in shape, False, OPT)[0]
    bs = P("dp") if "dp" in shape else P()

    def step(p, x, y):
        return shardspec.value_and_grad(pm.loss_fn, microbatches=2)(p, x, y)

    run = sharded(
        step,
        mesh=Mesh(shape, simulate=True),
        in_specs=(ps, bs, bs),
        out_specs=(P(), ps),
        pipeline=Pipeline("pp"),
    )
    _close(run(params, x, y), step(params, x, y))


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_remat_inside_a_pipeline_keeps_results_with_tp(schedule, v):
    """Each stage recomputes its microbatches' remat regions, tensor-parallel reductions included,
    and never repeats a send or recv (a recomputed recv once waited for a send that never came)."""
    params, state, x, y, _ = _setup()
    run = _compiled(pm.make_step(4, OPT, remat=True), params, {"pp": 2, "tp": 2}, Pipeline("pp", schedule, v))
    _close(run(params, state, x, y), pm.make_step(4, OPT)(params, state, x, y))
    stage = run.lower(params, state, x, y).program.programs[0]
    assert any(n.meta.get("shardspec_remat") for n in stage.graph.nodes)


def _gpt_pipelined(remat, schedule):
    from examples.models import gpt

    cfg = gpt.Config(vocab=64, seq=32, d=64, heads=4, layers=4)
    block = shardspec.remat(gpt.block) if remat else gpt.block

    def loss_fn(p, tok, tgt):
        h = torch.nn.functional.embedding(tok, p["wte"]) + p["wpe"][: tok.shape[1]]
        for i in range(cfg.layers):
            if i == 2:
                h = shardspec.pipeline_boundary(h)
            h = block(p, f"h.{i}.", h, cfg.heads)
        h = torch.nn.functional.layer_norm(h, (cfg.d,), p["ln_f.weight"], p["ln_f.bias"])
        logits = torch.nn.functional.linear(h, p["head.weight"])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))

    def step(p, s, tok, tgt):
        loss, grads = shardspec.value_and_grad(loss_fn, microbatches=4)(p, tok, tgt)
        p, s = OPT.update(grads, s, p)
        return p, s, loss, grads  # grads compared: AdamW magnifies the noise of the k bias's zero gradient

    params = gpt.init(cfg)
    g = torch.Generator().manual_seed(0)
    tok, tgt = (torch.randint(0, cfg.vocab, (32, cfg.seq), generator=g) for _ in range(2))
    ps = {k: P() for k in params}
    run = sharded(
        step,
        mesh=Mesh({"pp": 2, "dp": 2}, simulate=True),
        in_specs=(ps, OPT.state_specs(ps), P("dp"), P("dp")),
        out_specs=(ps, OPT.state_specs(ps), P(), ps),
        pipeline=Pipeline("pp", schedule),
    )
    return run, step, (params, OPT.init(params), tok, tgt)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_remat_inside_a_pipeline_lowers_each_stage_activations(schedule):
    """A pipelined GPT with remat'd blocks: the busiest stage's activation peak falls (to under a
    third here), the predicted peak is the one measured, and loss and gradients equal the
    unpipelined step's."""
    from tests.test_memory import _measured_peak

    run, step, args = _gpt_pipelined(True, schedule)
    plain = _gpt_pipelined(False, schedule)[0]
    with_remat = run.lower(*args).cost()
    without = plain.lower(*args).cost()
    assert with_remat.activation_peak_bytes_per_rank < 0.35 * without.activation_peak_bytes_per_rank
    assert run.lower(*args).peak_memory(0) == _measured_peak(run, args)  # (rank 0's, measured)
    assert with_remat.peak_memory_bytes_per_rank >= run.lower(*args).peak_memory(0)  # the busiest
    _close(run(*args)[2:], step(*args)[2:])


def test_error_boundary_on_a_parameter_says_so():
    def loss_fn(p, x, y):
        w1 = shardspec.pipeline_boundary(p["w1"])  # on a parameter, not an activation
        return torch.nn.functional.cross_entropy(torch.tanh(torch.tanh(x @ p["w0"]) @ w1) @ p["head"], y)

    p = {"w0": torch.randn(8, 8), "w1": torch.randn(8, 8), "head": torch.randn(8, 4)}
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    run = _pp2_gradients(loss_fn)
    with pytest.raises(ShardingError, match=r"(?s)applied to an input of the step.*on the activation"):
        run(p, x, y)


def _pp2_gradients(loss_fn):
    """The loss and gradients of ``loss_fn(p, x, y)`` in 2 microbatches, pipelined over pp = 2."""

    def step(p, x, y):
        return shardspec.value_and_grad(loss_fn, microbatches=2)(p, x, y)

    return sharded(
        step,
        mesh=Mesh({"pp": 2}, simulate=True),
        in_specs=(P(), P(), P()),
        out_specs=P(),
        pipeline=Pipeline("pp"),
    )


def test_cost_reports_the_busiest_position_peak() -> None:
    params, state, x, y, step = _setup()
    low = _compiled(step, params, {"pp": 2}, Pipeline("pp", "gpipe")).lower(params, state, x, y)
    assert low.cost().peak_memory_bytes_per_rank == max(low.peak_memory(r) for r in range(2))


def test_a_pipeline_with_dp_reports_each_position_own_collectives() -> None:
    """A stage program holds its position's collectives only: launches(rank) lists those (not every
    stage's), and cost() is the busiest rank's, as measured when the step runs."""
    params, state, x, y, step = _setup()
    run = _compiled(step, params, {"pp": 2, "dp": 2}, Pipeline("pp", "gpipe"))
    low = run.lower(params, state, x, y)
    with count_bytes() as sent:
        run(params, state, x, y)
    per_rank: dict[int, float] = {}
    launches: dict[int, int] = {}
    for rec in sent.records:
        for r, b in rec.bytes_by_rank.items():
            per_rank[r] = per_rank.get(r, 0.0) + b
            if rec.kind != "recv":  # (a receive is its send's other end)
                launches[r] = launches.get(r, 0) + 1
    busiest = max(per_rank, key=per_rank.__getitem__)
    assert low.cost().comm_bytes_per_rank == pytest.approx(per_rank[busiest])
    assert low.cost().collective_count == launches[busiest]
    for r in range(4):
        assert len(low.launches(r)) == launches[r]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_weight_gathered_for_backward_and_reused_by_the_next_forward(schedule: str) -> None:
    """A convolution's weight split over tp is gathered whole for its backward; the next
    microbatch's forward reuses that gather. It runs in the action of its first use in the
    position's schedule: it was placed in microbatch 0's backward, which 1F1B runs after
    microbatch 1's forward, and the step was refused."""
    import torch.nn.functional as F

    def loss_fn(p, x, y):
        h = F.conv2d(x, p["c1"], padding=1).relu()
        h = shardspec.pipeline_boundary(h)
        h = F.conv2d(h, p["c2"], padding=1).relu()
        h = shardspec.pipeline_boundary(h)
        h = F.conv2d(h, p["c3"])
        return F.cross_entropy(h.mean((2, 3)), y)

    opt = optim.sgd(lr=1e-2)

    def step(p, s, x, y):
        loss, g = shardspec.value_and_grad(loss_fn, microbatches=2)(p, x, y)
        return (*opt.update(g, s, p), loss)

    gen = torch.Generator().manual_seed(0)
    p = {
        k: torch.randn(*shape, generator=gen)
        for k, shape in {"c1": (4, 3, 3, 3), "c2": (4, 4, 3, 3), "c3": (4, 4, 1, 1)}.items()
    }
    x, y = torch.randn(8, 3, 6, 6, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    s = opt.init(p)
    ps = {"c1": P(), "c2": P("tp"), "c3": P()}
    run = sharded(
        step,
        mesh=Mesh({"pp": 2, "tp": 2}, simulate=True),
        in_specs=(ps, opt.state_specs(ps), P(), P()),
        out_specs=(ps, opt.state_specs(ps), P()),
        pipeline=Pipeline(axis="pp", schedule=schedule),
    )
    torch.testing.assert_close(run(p, s, x, y), step(p, s, x, y), rtol=1e-4, atol=1e-5)
