"""Pipelined steps on 4 gloo processes (pp2 x dp2, pp2 x tp2, pp4) equal the single-process step:
each rank returns its own stage's parameters, optimizer state and (last stage) loss, and the second
step takes them back as they came out."""

import os

import optree
import pytest
import torch

from benchmarks import pipeline_model as pm
from shardspec import Mesh, optim, to_global
from shardspec.layout import device_slices
from shardspec.testing import run_distributed

pytestmark = pytest.mark.multiprocess
D, HIDDEN, CLASSES, BATCH, M = 8, 16, 4, 16, 4


def _two_steps(rank, world, shape, schedule, v, layers, remat=False):
    from torch.distributed.tensor import DTensor

    from shardspec import P, Pipeline, sharded

    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    params = pm.init(layers, D, HIDDEN, CLASSES)
    state = opt.init(params)
    x, y = pm.data(BATCH, D, CLASSES)
    step = pm.make_step(M, opt, remat)
    mesh = Mesh(shape)
    ps, ss, xs, ys = pm.specs(params, "tp" in shape, "dp" in shape, opt)
    run = sharded(
        step,
        mesh=mesh,
        in_specs=(ps, ss, xs, ys),
        out_specs=(ps, ss, P()),
        pipeline=Pipeline("pp", schedule, v),
    )
    out = run(params, state, x, y)
    out = run(out[0], out[1], x, y)  # DTensors back as they came out (other stages' blocks empty)
    paths, leaves, _ = optree.tree_flatten_with_path(out, none_is_leaf=False)
    held = {}
    stage_size = mesh.size // mesh.axis_size("pp")
    for path, leaf in zip(paths, leaves, strict=True):
        assert isinstance(leaf, DTensor)
        # a stage's value lives on its sub-mesh; only a value every stage holds spans the mesh
        assert leaf.device_mesh.size() in (stage_size, mesh.size), (path, leaf.device_mesh)
        if "blocks" in str(path):  # parameters and moments: on their stage's sub-mesh only
            assert leaf.device_mesh.size() == stage_size, (path, leaf.device_mesh)
        local = leaf.to_local()
        if local.numel():  # a value of another stage is an empty block here
            held[str(path)] = local.clone()
    everywhere = dict(zip(*_flat(to_global(out)), strict=True))  # every value on every rank
    return {"rank": rank, "held": held, "global": everywhere}


@pytest.mark.parametrize(
    ("shape", "schedule", "v", "remat"),
    [
        ({"pp": 2, "dp": 2}, "1f1b", 1, False),
        ({"pp": 2, "dp": 2}, "interleaved", 2, False),
        ({"pp": 2, "tp": 2}, "gpipe", 1, False),
        ({"pp": 2, "tp": 2}, "1f1b", 1, True),  # blocks recomputed in backward, tp reductions too
        ({"pp": 4}, "zb-h1", 1, False),
    ],
)
def test_pipeline_on_gloo_matches_single_process(shape, schedule, v, remat):
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    layers = max(4, shape["pp"] * v)  # one layer per stage at least
    params = pm.init(layers, D, HIDDEN, CLASSES)
    x, y = pm.data(BATCH, D, CLASSES)
    step = pm.make_step(M, opt)
    want = step(params, opt.init(params), x, y)
    want = step(want[0], want[1], x, y)
    ps, ss, _, _ = pm.specs(params, "tp" in shape, "dp" in shape, opt)
    specs = dict(zip(*_flat((ps, ss, pm.P())), strict=True))
    reference = dict(zip(*_flat(want), strict=True))
    mesh = Mesh(shape, simulate=True)
    results = run_distributed(_two_steps, 4, args=(shape, schedule, v, layers, remat), timeout=240)
    seen = set()
    for r in results:
        stage = mesh.axis_index(r["rank"], "pp")
        assert r["held"], f"rank {r['rank']} holds nothing"
        for path, local in r["held"].items():
            full = reference[path]
            block = full[device_slices(tuple(full.shape), mesh, specs[path], r["rank"])]
            torch.testing.assert_close(local, block, rtol=1e-5, atol=1e-6)
            seen.add(path)
        blocks = {p for p in r["held"] if "'blocks'" in p}
        assert blocks, f"stage {stage} holds no block parameters"
        assert r["global"].keys() == reference.keys()
        for path, value in r["global"].items():  # shardspec.to_global: the global value, on every rank
            torch.testing.assert_close(value, reference[path], rtol=1e-5, atol=1e-6)
    assert seen == set(reference)  # every result is held by some stage


def _flat(tree):
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    return [str(p) for p in paths], leaves


FULL = [
    (shape, schedule, 2 if schedule == "interleaved" else 1)
    for shape in ({"pp": 2, "dp": 2}, {"pp": 2, "tp": 2}, {"pp": 4})
    for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1")
]


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "schedule", "v"), FULL)
def test_every_schedule_on_every_gloo_mesh(shape, schedule, v):
    """All 12 (mesh, schedule) pairs: SHARDSPEC_PIPELINE=full (about 3 minutes); CI runs the four
    pairs of test_pipeline_on_gloo_matches_single_process."""
    if os.environ.get("SHARDSPEC_PIPELINE") != "full":
        pytest.skip("the full mesh x schedule matrix runs with SHARDSPEC_PIPELINE=full")
    test_pipeline_on_gloo_matches_single_process(shape, schedule, v, remat=False)


def _tied_loss(p, x, y):
    import torch.nn.functional as F

    import shardspec

    h = shardspec.pipeline_boundary(torch.tanh(x @ p["w"]))
    return F.cross_entropy(torch.tanh(h @ p["w"]) @ p["head"], y)  # "w" read by both stages


def _tied_setup():
    import shardspec

    opt = optim.sgd(lr=0.1)

    def step(p, s, x, y):
        loss, g = shardspec.value_and_grad(_tied_loss, microbatches=2)(p, x, y)
        p, s = opt.update(g, s, p)
        return p, s, loss

    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(8, 8, generator=g), "head": torch.randn(8, 3, generator=g)}
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    return opt, step, p, x, y


def _tied_two_steps(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from shardspec import P, Pipeline, ShardingError, sharded

    opt, step, p, x, y = _tied_setup()
    ps = {"w": P(), "head": P()}
    run = sharded(
        step,
        mesh=Mesh({"pp": 2, "dp": 2}),
        in_specs=(ps, opt.state_specs(ps), P("dp"), P("dp")),
        out_specs=(ps, opt.state_specs(ps), P()),
        pipeline=Pipeline("pp", "1f1b"),
    )
    out = run(p, opt.init(p), x, y)
    out = run(out[0], out[1], x, y)  # "w" came back on one stage's sub-mesh; both stages read it
    held = {k: v.to_local().clone() for k, v in out[0].items() if v.to_local().numel()}
    # a DTensor on another mesh, read by stage 1 only: every rank raises the same error
    other = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    bad = dict(p, head=distribute_tensor(p["head"], other, [Replicate()]))
    try:
        run(bad, opt.init(p), x, y)
        error = ""
    except ShardingError as e:
        error = str(e)
    return held, error


def test_weight_read_by_two_stages_goes_into_the_next_step_on_gloo():
    """A weight both stages read (tied embedding/head) returns on the sub-mesh of the stage that
    updated it; the next step takes it back on every rank and equals one process's two steps. A
    bad input read by one stage only is the same error on every rank (no rank left hanging)."""
    opt, step, p, x, y = _tied_setup()
    want = step(p, opt.init(p), x, y)
    want = step(want[0], want[1], x, y)[0]
    results = run_distributed(_tied_two_steps, 4, timeout=120)
    held = [r[0] for r in results]
    errors = {r[1] for r in results}
    assert len(errors) == 1 and "p['head'] is a DTensor on DeviceMesh" in errors.pop()
    for name in want:
        got = [r[name] for r in held if name in r]
        assert got, f"no rank returned {name}"
        for g in got:
            torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6)
