"""ZeRO-3's memory schedule (compiler/passes/regather.py) and the peak-memory estimate of cost():
parameters gathered again for backward, gradients freed once their reduce-scatter is done, results
equal with the schedule on and off, and the predicted peak equal to the peak of live storage
measured while rank 0 runs on a simulated mesh (DP, ZeRO-1, ZeRO-3, with and without donation)."""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import optree
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shardspec
from collectives.simulated import run_simulated
from examples.models import gpt
from shardspec import Mesh, P, optim, sharded
from shardspec.layout import shard

N = 4
PHI = (N - 1) / N
OPT = optim.adamw(lr=1e-3, weight_decay=0.01, eps=1e-6)
ops = torch.ops.shardspec


def _mlp3(params, x, y):
    """Three bias-free layers: backward reads w1 and w2 (the hidden gradients), never w0."""
    h = torch.tanh(x @ params["w0"])
    h = torch.tanh(h @ params["w1"])
    return torch.nn.functional.cross_entropy(h @ params["w2"], y)


def _step(loss_fn):
    def step(p, s, *batch):
        loss, g = shardspec.value_and_grad(loss_fn)(p, *batch)
        p, s = OPT.update(g, s, p)
        return p, s, loss

    return step


def _zero3(step, params, passes):
    batch_spec = P("dp")
    pspec = {k: P("dp") for k in params}
    return sharded(
        step,
        mesh=Mesh({"dp": N}, simulate=True),
        in_specs=(pspec, OPT.state_specs(pspec), batch_spec, batch_spec),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
        passes=passes,
    )


def _gathers_and_scatters(low):
    records = [r for r in low.collectives() if r.shape != ()]
    gathers = sum(r.bytes_per_rank for r in records if r.kind == "all_gather")
    scatters = sum(r.bytes_per_rank for r in records if r.kind == "reduce_scatter")
    return gathers, scatters


def test_regather_sends_parameters_read_in_backward_twice_and_computes_the_same():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(8, 8, generator=g) / 3 for k in ("w0", "w1", "w2")}
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 8, (16,), generator=g)
    step = _step(_mlp3)
    psi, psi_backward = 3 * 64, 2 * 64
    out, bytes_ = {}, {}
    for regather in (True, False):
        f = _zero3(step, params, {"regather": regather})
        out[regather] = f(params, OPT.init(params), x, y)
        bytes_[regather] = _gathers_and_scatters(f.lower(params, OPT.init(params), x, y))
    for a, b in zip(optree.tree_leaves(out[True]), optree.tree_leaves(out[False]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # k phi Psi (2 w_p + w_g) for what backward reads; phi Psi (w_p + w_g) without the schedule
    assert bytes_[True] == (PHI * (psi + psi_backward) * 4, PHI * psi * 4)
    assert bytes_[False] == (PHI * psi * 4, PHI * psi * 4)


def _gpt(passes):
    cfg = gpt.Config(layers=3)
    params = gpt.init(cfg)

    def loss_fn(p, tok, tgt):
        return gpt.loss_fn(p, tok, tgt, cfg)

    tok = torch.randint(0, cfg.vocab, (8, cfg.seq), generator=torch.Generator().manual_seed(1))
    f = _zero3(_step(loss_fn), params, passes)
    return f, params, OPT.init(params), tok


def test_gpt_zero3_regather_doubles_weight_gathers_and_lowers_the_peak():
    small = {"zero_bucket_bytes": 4096}
    on, params, state, tok = _gpt(small)
    off = _gpt({**small, "regather": False})[0]
    low_on, low_off = on.lower(params, state, tok, tok), off.lower(params, state, tok, tok)
    (g_on, s_on), (g_off, s_off) = _gathers_and_scatters(low_on), _gathers_and_scatters(low_off)
    assert s_on == s_off  # gradients are reduced once either way
    again = [c for launch in low_on.launches() for c in launch if c.node.endswith("@regather")]
    assert g_on == g_off + sum(c.bytes_per_rank for c in again)
    assert 1.8 * g_off < g_on <= 2 * g_off  # every weight matrix again; biases and wte are not read
    assert low_on.cost().peak_memory_bytes_per_rank < low_off.cost().peak_memory_bytes_per_rank
    for a, b in zip(
        optree.tree_leaves(on(params, state, tok, tok)),
        optree.tree_leaves(off(params, state, tok, tok)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_backward_gathers_are_prefetched_one_layer_ahead_not_at_the_top_of_backward():
    f, params, state, tok = _gpt({"zero_bucket_bytes": 4096})
    gm = f.lower(params, state, tok, tok).program.programs[0]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    again = [
        n
        for n in nodes
        if n.target is ops.all_gather.default
        and any(m.endswith("@regather") for m in n.meta.get("shardspec_members", ()))
    ]
    assert len(again) >= 3
    backward = [i for i, n in enumerate(nodes) if n.meta.get("shardspec_backward")]

    def first_use(gather):
        (wait,) = gather.users
        return min(pos[u] for u in wait.users)

    for k in range(1, len(again)):  # issued one launch ahead: after the previous one's layer began
        assert first_use(again[k - 1]) > pos[again[k]] > pos[again[k - 1]]
    assert pos[again[-1]] > (backward[0] + backward[-1]) // 2  # the last in backward's second half


def test_a_gradient_reduce_scatter_is_waited_before_the_next_one_is_packed():
    f, params, state, tok = _gpt({"zero_bucket_bytes": 4096})
    gm = f.lower(params, state, tok, tok).program.programs[0]
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    scatters = [n for n in nodes if n.target is ops.reduce_scatter.default]
    assert len(scatters) >= 3
    for c, following in itertools.pairwise(scatters):
        (wait,) = c.users
        packed = min(pos[x] for x in following.all_input_nodes)  # the next bucket's flat buffer
        assert pos[wait] < packed


def test_pass_options_name_the_memory_trade():
    from compiler import passes as cp

    assert cp.options(None).regather and cp.options(None).zero_bucket_bytes is None
    assert not cp.options({"regather": False}).regather
    assert dataclasses.replace(cp.PassOptions(), zero_bucket_bytes=1 << 20).zero_bucket_bytes == 1 << 20
    for off in ("False", "off", 0, None):  # each would count as on (or as an error later)
        not_bool = r"'pack_early': .*\}\) is not True or False"
        with pytest.raises(shardspec.ShardingError, match=not_bool):
            cp.options({"pack_early": off})
    import numpy as np

    assert not cp.options({"pack_early": np.bool_(False)}).pack_early


class _LiveStorage(TorchDispatchMode):  # type: ignore[misc]
    """Bytes of the storages that some tensor still references, after each op of one thread."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[int, tuple[int, list[weakref.ref[torch.Tensor]]]] = {}
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        entry = self.buffers.get(key)
        if entry is None or not any(r() is not None for r in entry[1]):  # new, or an address reused
            entry = self.buffers[key] = (storage.nbytes(), [])
        entry[1].append(weakref.ref(t))

    def live(self) -> int:
        return sum(n for n, refs in self.buffers.values() if any(r() is not None for r in refs))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                self.add(t)
        self.peak = max(self.peak, self.live())
        return out


def _measured_peak(f, args):
    """Run the step on its simulated mesh, tracking rank 0's live storage op by op."""
    program = f._program(args)[0]
    leaves = optree.tree_leaves(args, none_is_leaf=False)
    tensors = [leaves[i] for i in program.traced.tensor_positions]
    pieces = [shard(t, program.mesh, s) for t, s in zip(tensors, program.in_specs, strict=True)]
    tracker = _LiveStorage()

    def body(rank):
        local = [p[rank] for p in pieces]
        with torch.no_grad():
            if rank != 0:
                return program.programs[rank](*local)
            for t in local:
                tracker.add(t)
            tracker.peak = tracker.live()
            with tracker:  # dispatch modes are per thread: only rank 0 is tracked
                return program.programs[rank](*local)

    run_simulated(body, program.mesh)
    return tracker.peak


@pytest.mark.parametrize(
    ("strategy", "donate"), [("dp", ()), ("zero1", ()), ("zero3", ()), ("zero3", (0, 1)), ("dp", (0, 1))]
)
def test_predicted_peak_matches_the_peak_measured_on_a_simulated_mesh(strategy, donate):
    cfg = gpt.Config(vocab=64, seq=32, d=64, heads=4, layers=2)
    params = gpt.init(cfg)
    rep, split = {k: P() for k in params}, {k: P("dp") for k in params}
    pspec, sspec = {"dp": (rep, rep), "zero1": (rep, split), "zero3": (split, split)}[strategy]

    def loss_fn(p, tok, tgt):
        return gpt.loss_fn(p, tok, tgt, cfg)

    f = sharded(
        _step(loss_fn),
        mesh=Mesh({"dp": N}, simulate=True),
        in_specs=(pspec, OPT.state_specs(sspec), P("dp"), P("dp")),
        out_specs=(pspec, OPT.state_specs(sspec), P()),
        donate=donate,
    )
    tok = torch.randint(0, cfg.vocab, (2 * N, cfg.seq), generator=torch.Generator().manual_seed(2))
    args = (params, OPT.init(params), tok, tok)
    predicted = f.lower(*args).cost().peak_memory_bytes_per_rank
    measured = _measured_peak(f, args)
    assert abs(predicted - measured) <= 0.05 * measured


def _traced(fn, *args):
    """``fn`` as an fx program with fake values on its nodes (what liveness reads)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = torch.fx.symbolic_trace(fn)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*args)
    return gm


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather", "all_reduce"])
def test_an_async_collectives_input_is_held_as_predicted_on_a_simulated_mesh(kind):
    """A buffer sent by an async collective and read by nothing else: an all-gather or reduce-
    scatter holds it until the wait (as c10d's work does), an all-reduce copies it into its output
    at launch. The model and a simulated run agree op by op, so the peak (a buffer made while the
    collective is in flight) is the same."""
    from collectives.ops import mesh_key
    from compiler.passes import liveness

    mesh = Mesh({"dp": 2}, simulate=True)
    key = mesh_key(mesh)
    kwargs = {"axis": "dp", "mesh": key, "async_op": True}
    launch = {
        "reduce_scatter": lambda b: ops.reduce_scatter.default(b, dim=0, **kwargs),
        "all_gather": lambda b: ops.all_gather.default(b, dim=0, **kwargs),
        "all_reduce": lambda b: ops.all_reduce.default(b, **kwargs),
    }[kind]

    def program(x):
        y = launch(x * 2)  # the sent buffer's only reader is the launch
        t = x + 1  # made while the collective is in flight
        return ops.wait.default(y), t

    x = torch.ones(1 << 14, 4)
    gm = _traced(program, x)
    assert any(n.target is ops.wait.default for n in gm.graph.nodes)
    tracker = _LiveStorage()

    def body(rank):
        with torch.no_grad():
            if rank != 0:
                return gm(x.clone())
            local = x.clone()
            tracker.add(local)
            with tracker:
                return gm(local)

    run_simulated(body, mesh)
    assert liveness.peak(gm) == tracker.peak


def test_a_multi_output_ops_results_are_counted_once():
    """``native_layer_norm`` allocates its three results once: the tuple and each ``getitem`` are
    the same storage (an unread result dies with the tuple), and the model's peak is the peak of
    live storage measured while the program runs."""
    from compiler.passes import liveness

    def program(x, w, b):
        out, _mean, rstd = torch.ops.aten.native_layer_norm.default(x, [64], w, b, 1e-5)
        return out * rstd

    args = (torch.randn(4096, 64), torch.ones(64), torch.zeros(64))
    gm = _traced(program, *args)
    tracker = _LiveStorage()
    for t in args:
        tracker.add(t)
    with torch.no_grad(), tracker:
        gm(*args)
    assert liveness.peak(gm) == tracker.peak


@pytest.mark.parametrize("n", [4, 8])
def test_zero2_peak_with_remat_and_donation_matches_the_measured_peak(n):
    """docs/memory.md's ZeRO-2 rows with remat and donation (bf16 parameters and gradients, fp32
    master and moments): their peak falls in backward while the first gradient bucket's
    reduce-scatter is in flight and the next bucket is being packed (pack_early), so it holds the
    bytes the launch keeps until its wait; the run on a simulated mesh holds them as c10d does."""
    from benchmarks.memory_table import Row, simulated_row

    row = simulated_row(Row("zero2", n, remat=True, donate=True))
    assert abs(row.predicted - row.measured) <= 0.05 * row.measured


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero3"])
def test_fp32_model_state_bytes_follow_the_zero_formulas(strategy, n):
    """fp32 AdamW (parameters, gradients, both moments 4 bytes each). Gradients are counted at the
    layout the update reads them: ZeRO-1 here reduce-scatters them (the update runs on the
    optimizer state's shard), so it already holds ZeRO-2's gradient shard: 4Ψ + 12Ψ/N. The
    mixed-precision formulas (ZeRO-2's 2Ψ + 14Ψ/N) are checked in tests/test_mixed_precision.py."""
    cfg = gpt.Config(vocab=64, seq=16, d=32, heads=4, layers=1)
    params = gpt.init(cfg)
    psi = sum(v.numel() for v in params.values())
    rep, split = {k: P() for k in params}, {k: P("dp") for k in params}
    pspec, sspec = {"dp": (rep, rep), "zero1": (rep, split), "zero3": (split, split)}[strategy]

    def loss_fn(p, tok, tgt):
        return gpt.loss_fn(p, tok, tgt, cfg)

    f = sharded(
        _step(loss_fn),
        mesh=Mesh({"dp": n}, simulate=True),
        in_specs=(pspec, OPT.state_specs(sspec), P("dp"), P("dp")),
        out_specs=(pspec, OPT.state_specs(sspec), P()),
        donate=(0, 1),
    )
    tok = torch.randint(0, cfg.vocab, (n, cfg.seq), generator=torch.Generator().manual_seed(3))
    cost = f.lower(params, OPT.init(params), tok, tok).cost()
    formula = {"dp": 16, "zero1": 4 + 12 / n, "zero3": 16 / n}[strategy] * psi
    assert abs(cost.model_state_bytes_per_rank - formula) <= 0.05 * formula
    assert cost.grad_bytes_per_rank == (4 * psi if strategy == "dp" else 4 * psi // n)


def test_zero3_peak_falls_with_the_mesh_on_a_model_state_dominated_config():
    """Wide layers (d=256, 4 layers, each under remat), one sequence of 8 tokens per rank, fp32
    AdamW, donation on, parameter-gather buckets of 256 KiB (about a twelfth of a layer): model
    states (16Ψ/N) dominate, so the peak follows them down. A gradient computed whole (from
    gathered activations) is sliced as soon as it exists, not held to the optimizer
    (passes/slice_early.py)."""
    import torch.nn.functional as F

    cfg = gpt.Config(vocab=64, seq=8, d=256, heads=4, layers=4)
    params = gpt.init(cfg)
    block = shardspec.remat(gpt.block)

    def loss_fn(p, tok, tgt):
        x = F.embedding(tok, p["wte"]) + p["wpe"][: tok.shape[1]]
        for i in range(cfg.layers):
            x = block(p, f"h.{i}.", x, cfg.heads)
        x = F.layer_norm(x, (cfg.d,), p["ln_f.weight"], p["ln_f.bias"])
        return F.cross_entropy(F.linear(x, p["head.weight"]).reshape(-1, cfg.vocab), tgt.reshape(-1))

    peaks = {}
    for n in (2, 8):
        split = {k: P("dp") for k in params}
        f = sharded(
            _step(loss_fn),
            mesh=Mesh({"dp": n}, simulate=True),
            in_specs=(split, OPT.state_specs(split), P("dp"), P("dp")),
            out_specs=(split, OPT.state_specs(split), P()),
            donate=(0, 1),
            passes={"zero_bucket_bytes": 2**18},
        )
        tok = torch.randint(0, cfg.vocab, (n, cfg.seq), generator=torch.Generator().manual_seed(4))
        peaks[n] = f.lower(params, OPT.init(params), tok, tok).cost().peak_memory_bytes_per_rank
    assert peaks[8] <= 0.35 * peaks[2]


def test_memory_table_smoke(monkeypatch):
    """docs/memory.md's generator (benchmarks/memory_table.py), bounded: a 1-layer model, one
    simulated row and the same step on 2 gloo processes (forked: they see the patched model), each
    rank's peak of live storage measured against cost()."""
    from benchmarks import memory_table
    from benchmarks.memory_table import Row, _gloo, simulated_row
    from shardspec.testing import run_distributed

    monkeypatch.setattr(memory_table, "CFG", gpt.Config(vocab=128, seq=32, d=128, heads=4, layers=1))

    row = simulated_row(Row("zero3", 2, remat=True, donate=True))
    assert abs(row.model_state - 8 * row.psi) <= 0.05 * 8 * row.psi  # 16Ψ/N
    assert abs(row.predicted - row.measured) <= 0.05 * row.measured
    # DP's real-mesh program writes weight gradients straight into its held bucket (mm.out)
    rows = [Row(s, 0, remat=False, donate=True) for s in ("zero3", "dp")]
    per_rank = run_distributed(_gloo, 2, args=(rows,), timeout=600)
    for out in per_rank:
        for measured in out["rows"]:
            assert abs(measured.predicted - measured.measured) <= 0.05 * measured.measured
