"""Communication of @sharded steps, in bytes per rank, against the formulas of
docs/guide/performance.md (fp32, k = 1).

N = group size, phi = (N - 1) / N, Psi = parameter count. The loss adds scalar all-reduces (the
summed loss and, for cross-entropy, the count of targets): those are checked apart, by shape.
"""

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import collectives
import shardspec
from examples.models import mlp
from shardspec import Mesh, P, optim, sharded

N = 4
PHI = (N - 1) / N
D_IN, D_HIDDEN, D_OUT, BATCH = 8, 16, 4, 16
OPT = optim.adamw(lr=1e-2, weight_decay=0.0)
STEP = mlp.make_step(OPT)


def _setup():
    params = mlp.init(D_IN, D_HIDDEN, D_OUT)
    x = torch.randn(BATCH, D_IN)
    y = torch.randint(0, D_OUT, (BATCH,))
    return params, OPT.init(params), x, y


PSI = sum(t.numel() for t in mlp.init(D_IN, D_HIDDEN, D_OUT).values())


def _split(records):
    tensors = [r for r in records if r.shape != ()]
    scalars = [r for r in records if r.shape == ()]
    return tensors, scalars


def _compile_and_check(pspec, sspec, bspec, mesh):
    params, state, x, y = _setup()
    step = sharded(STEP, mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P()))
    low = step.lower(params, state, x, y)
    with collectives.count_bytes() as counter:
        out = step(params, state, x, y)
    for a, b in zip(out[0].values(), STEP(params, state, x, y)[0].values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # what the plan says is what the backend sent
    assert counter.total_bytes_per_rank == low.cost().comm_bytes_per_rank
    assert counter.count == low.cost().collective_count * 1  # one record per group call (1 group)
    tensors, scalars = _split(low.collectives())
    assert len(scalars) <= 2 and all(r.kind == "all_reduce" for r in scalars)
    return low, tensors


def test_data_parallel_is_one_gradient_all_reduce():
    mesh = Mesh({"dp": N}, simulate=True)
    _, tensors = _compile_and_check(P(), P(), P("dp"), mesh)
    assert [r.kind for r in tensors] == ["all_reduce"] * 3
    assert sum(r.bytes_per_rank for r in tensors) == 2 * PHI * PSI * 4


def test_zero1_reduce_scatters_gradients_and_gathers_params():
    mesh = Mesh({"dp": N}, simulate=True)
    pspec = {"w1": P(), "b1": P(), "w2": P()}
    sspec = OPT.state_specs({"w1": P("dp"), "b1": P("dp"), "w2": P("dp")})
    _, tensors = _compile_and_check(pspec, sspec, P("dp"), mesh)
    kinds = sorted(r.kind for r in tensors)
    assert kinds == ["all_gather"] * 3 + ["reduce_scatter"] * 3  # never all-reduce plus slice
    assert sum(r.bytes_per_rank for r in tensors) == PHI * PSI * (4 + 4)


def test_zero3_gathers_params_and_reduce_scatters_gradients():
    mesh = Mesh({"dp": N}, simulate=True)
    pspec = {"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}
    _, tensors = _compile_and_check(pspec, OPT.state_specs(pspec), P("dp"), mesh)
    gathers = [r for r in tensors if r.kind == "all_gather"]
    scatters = [r for r in tensors if r.kind == "reduce_scatter"]
    assert len(gathers) + len(scatters) == len(tensors)
    # w2 (the only weight backward reads: the hidden gradient) is gathered again for backward
    assert sum(r.bytes_per_rank for r in gathers) == PHI * (PSI + D_HIDDEN * D_OUT) * 4
    assert sum(r.bytes_per_rank for r in scatters) == PHI * PSI * 4


def _megatron(with_layer_before: bool, d_in: int = D_IN):
    mesh = Mesh({"tp": N}, simulate=True)
    params = mlp.init(d_in, D_HIDDEN, D_OUT)
    x, y = torch.randn(BATCH, d_in), torch.randint(0, D_OUT, (BATCH,))
    pspec = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}
    if with_layer_before:
        params["w0"] = torch.randn(d_in, d_in) / d_in**0.5
        pspec["w0"] = P()

    def loss_fn(p, x, y):
        if "w0" in p:
            x = torch.tanh(x @ p["w0"])  # a replicated layer before the MLP needs the MLP's input grad
        h = F.gelu(x @ p["w1"] + p["b1"])
        return F.cross_entropy(h @ p["w2"], y)

    def step(p, s, x, y):
        loss, g = shardspec.value_and_grad(loss_fn)(p, x, y)
        p, s = OPT.update(g, s, p)
        return p, s, loss

    state = OPT.init(params)
    f = sharded(
        step,
        mesh=mesh,
        in_specs=(pspec, OPT.state_specs(pspec), P(), P()),
        out_specs=(pspec, OPT.state_specs(pspec), P()),
    )
    low = f.lower(params, state, x, y)
    out = f(params, state, x, y)
    want = step(params, state, x, y)
    for k in params:
        torch.testing.assert_close(out[0][k], want[0][k], rtol=1e-4, atol=1e-5)
    return low


def test_megatron_mlp_is_one_forward_all_reduce():
    low = _megatron(with_layer_before=False)
    records = low.collectives()
    assert [(r.kind, r.shape) for r in records] == [("all_reduce", (BATCH, D_OUT))]
    assert low.cost().comm_bytes_per_rank == 2 * PHI * BATCH * D_OUT * 4


def test_megatron_mlp_all_reduces_its_input_gradient_when_needed():
    d_in = 32  # the input gradient (16 x 32) is smaller than the layer-before's weight grad (32 x 32)
    low = _megatron(with_layer_before=True, d_in=d_in)
    records = low.collectives()
    assert sorted((r.kind, r.shape) for r in records) == [
        ("all_reduce", (BATCH, D_OUT)),
        ("all_reduce", (BATCH, d_in)),
    ]
    assert low.cost().comm_bytes_per_rank == 2 * PHI * BATCH * (D_OUT + d_in) * 4
    backward = next(r for r in records if r.shape == (BATCH, d_in))
    # reduced in backward, where the replicated layer needs it whole (the pending sum may pass
    # through same-size linear backward ops such as tanh's first: same bytes)
    assert backward.source.startswith("backward of")


def test_a_pending_input_gradient_is_reduced_where_it_is_smallest():
    """The pending input gradient stays pending through the layer before when that layer's weight
    gradient is smaller than the input gradient (8 x 8 < 16 x 8): one all-reduce either way, of
    the smaller tensor."""
    low = _megatron(with_layer_before=True, d_in=8)
    records = low.collectives()
    assert sorted((r.kind, r.shape) for r in records) == [
        ("all_reduce", (8, 8)),
        ("all_reduce", (BATCH, D_OUT)),
    ]


def test_explain_names_values_and_user_lines_for_each_collective():
    mesh = Mesh({"dp": N}, simulate=True)
    params, state, x, y = _setup()
    f = sharded(STEP, mesh=mesh, in_specs=(P(), P(), P("dp"), P("dp")), out_specs=(P(), P(), P()))
    low = f.lower(params, state, x, y)
    text = low.explain()
    members = re.findall(r"^  \[(\d+)\] ", text, re.M)
    assert len(set(members)) == low.cost().collective_count and len(members) == len(low.collectives())
    groups = [line for line in text.splitlines()[1:] if line and not line.startswith((" ", "totals"))]
    assert groups and all("mlp.py:" in g for g in groups)  # the model file's lines, not library code
    for name in params:  # each gradient reduction named by its parameter, under the forward line
        assert f"gradient of params['{name}']" in text
    assert "opt.update" not in text


@pytest.mark.parametrize("shape", [(7, 5), (5, 7), (6, 6)])
def test_an_uneven_all_to_all_is_priced_at_its_busiest_rank(shape: tuple[int, int]) -> None:
    """Rows over 3 devices moved to columns: each rank sends its own rows (3, 3 and 1 of 7) less
    the piece it keeps; cost() and explain() report what the busiest rank really sends."""
    mesh = Mesh({"b": 3}, simulate=True)
    x = torch.randn(*shape)
    step = sharded(lambda a: a * 2, mesh=mesh, in_specs=(P("b"),), out_specs=P(None, "b"))
    low = step.lower(x)
    with collectives.count_bytes() as counter:
        assert torch.equal(step(x), x * 2)
    assert low.cost().comm_bytes_per_rank == counter.total_bytes_per_rank
    assert [c.bytes_per_rank for c in low.collectives()] == [counter.total_bytes_per_rank]


def test_layouts_that_differ_only_by_size_1_axes_communicate_nothing() -> None:
    """With one ``tp`` device, ``P(("tp", "dp"))`` holds every rank's block of ``P("dp")``: a reshard
    between such layouts (and a pending sum over one device) is free, and the value exact."""
    import itertools

    from shardspec.layout import device_slices

    mesh = Mesh({"dp": 2, "tp": 1}, simulate=True)
    x = torch.randn(4, 6)
    entries = [None, "dp", "tp", ("dp", "tp"), ("tp", "dp")]
    specs = []
    for a, b in itertools.product(entries, entries):
        try:
            P(a, b).validate(mesh, 2)
        except shardspec.ShardingError:
            continue  # an axis used twice
        specs.append(P(a, b))
    same = [
        (s, d)
        for s, d in itertools.product(specs, specs)
        if all(
            device_slices(x.shape, mesh, s, r) == device_slices(x.shape, mesh, d, r) for r in range(mesh.size)
        )
    ]
    assert len(same) > len(specs)  # pairs of distinct specs with the same blocks are among them
    for s, d in same:
        low = sharded(lambda x: x * 1, mesh=mesh, in_specs=(s,), out_specs=d).lower(x)
        assert low.cost().collective_count == 0, (s, d, low.collectives())
        torch.testing.assert_close(sharded(lambda x: x * 1, mesh=mesh, in_specs=(s,), out_specs=d)(x), x)
    # a contraction split over tuples with a size-1 axis, in either order: planned as over dp alone
    w = torch.randn(6, 3)

    def mm(xs: P, ws: P) -> Any:
        return sharded(lambda x, w: x @ w, mesh=mesh, in_specs=(xs, ws), out_specs=P())

    tuples = mm(P(None, ("tp", "dp")), P(("dp", "tp")))
    plain = mm(P(None, "dp"), P("dp"))
    assert tuples.lower(x, w).cost() == plain.lower(x, w).cost()
    torch.testing.assert_close(tuples(x, w), x @ w)


def test_data_parallel_conv_net_sends_its_gradients_not_its_activations() -> None:
    """convolution_backward's input and weight gradients are asked one at a time: together one
    rule kept the batch whole and data parallel gathered every activation (50x the gradients)."""
    gen = torch.Generator().manual_seed(0)
    p = {
        "c1": torch.randn(8, 3, 3, 3, generator=gen),
        "b1": torch.randn(8, generator=gen),
        "c2": torch.randn(8, 8, 3, 3, generator=gen),
        "fc": torch.randn(8, 5, generator=gen),
    }

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.conv2d(x, p["c1"], p["b1"], padding=1).relu()
        h = F.conv2d(h, p["c2"], padding=1).relu()
        return F.cross_entropy(h.mean((2, 3)) @ p["fc"], y)

    def grads(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        return shardspec.value_and_grad(loss_fn)(p, x, y)

    x, y = torch.randn(16, 3, 8, 8, generator=gen), torch.randint(0, 5, (16,), generator=gen)
    step = sharded(
        grads, mesh=Mesh({"dp": N}, simulate=True), in_specs=(P(), P("dp"), P("dp")), out_specs=P()
    )
    tensors, _ = _split(step.lower(p, x, y).collectives())
    assert {r.kind for r in tensors} == {"all_reduce"}
    assert sum(r.bytes_per_rank for r in tensors) == 2 * PHI * sum(t.numel() for t in p.values()) * 4
    loss, g = step(p, x, y)
    want_loss, want = grads(p, x, y)
    torch.testing.assert_close(loss, want_loss)
    for k in p:
        torch.testing.assert_close(g[k], want[k], rtol=1e-4, atol=1e-5)
