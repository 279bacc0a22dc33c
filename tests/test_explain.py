"""explain() in the user's words: values named by pytree path or by the parameter a gradient belongs
to, filed under the source line they come from, totals per kind and axes, whole-element bytes."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

import shardspec
from compiler.explain import human_bytes, ring_all_reduce_bytes
from examples.models import gpt, mlp
from examples.train_gpt import OPT, batch, make_step, strategy_specs
from shardspec import Mesh, P, optim, sharded

MLP_OPT = optim.adamw(lr=1e-2)


def _mlp(pspec: dict[str, P], axes: dict[str, int]) -> str:
    params = mlp.init(8, 16, 4)
    sspec = MLP_OPT.state_specs(pspec)
    step = sharded(
        mlp.make_step(MLP_OPT),
        mesh=Mesh(axes, simulate=True),
        in_specs=(pspec, sspec, P("dp"), P("dp")),
        out_specs=(pspec, sspec, P()),
    )
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    return step.lower(params, MLP_OPT.init(params), x, y).explain()


def _groups(text: str) -> dict[str, list[str]]:
    """Source line -> the lines listed under it."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines()[1:]:
        if not line or line.startswith("totals"):
            current = None
        elif not line.startswith(" "):
            current = line
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


def test_no_graph_node_names_or_rule_notation() -> None:
    text = _mlp({"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}, {"dp": 2, "tp": 2})
    assert not re.search(r"\b[a-z_]+_\d+\b", text), text  # view_copy_46, permute_copy_2, sum_2 ...
    assert "rule" not in text and "->" not in text


def test_gradient_reductions_are_filed_under_the_forward_line_using_the_weight() -> None:
    cfg = gpt.Config(layers=1)
    params = gpt.init(cfg)
    pspec = strategy_specs("dp-tp", params, {"dp": 2, "tp": 2})
    sspec = OPT.state_specs(pspec)
    step = sharded(
        make_step(cfg),
        mesh=Mesh({"dp": 2, "tp": 2}, simulate=True),
        in_specs=(pspec, sspec, P("dp"), P("dp")),
        out_specs=(pspec, sspec, P()),
    )
    text = step.lower(params, OPT.init(params), *batch(0, cfg)).explain()
    groups = _groups(text)
    fc = next(g for g in groups if 'p[pre + "mlp.fc.weight"]' in g)
    assert any("gradient of params['h.0.mlp.fc.weight']" in item for item in groups[fc])
    assert not any("OPT.update" in g for g in groups)  # not the optimizer's line
    for name in params:  # every parameter's gradient is named
        assert f"gradient of params['{name}']" in text


def test_arguments_are_named_by_their_path_and_partial_sums_by_the_line_that_made_them() -> None:
    zero3 = _mlp({"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}, {"dp": 4})
    assert "all_gather over dp: params['w1']" in zero3 and "stored split (P('dp'))" in zero3
    assert "reduce_scatter over dp: gradient of params['w1']" in zero3
    tp = _mlp({"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}, {"dp": 2, "tp": 2})
    line = next(g for g, items in _groups(tp).items() if any("all_reduce over tp" in i for i in items))
    assert 'h @ params["w2"]' in line  # the matmul whose contraction is split over tp


def test_totals_per_kind_and_axes_add_up_to_the_header() -> None:
    text = _mlp({"w1": P("dp"), "b1": P("dp"), "w2": P("dp")}, {"dp": 4})
    header = re.search(r"(\d+) collective launch\(es\) moving (\d+) tensor\(s\), (.+?) sent per rank", text)
    assert header is not None
    totals = re.findall(r"^  \S+ over \S+: (\d+) launch\(es\), (\d+) tensor\(s\)", text, re.M)
    assert sum(int(t[0]) for t in totals) == int(header.group(1))
    assert sum(int(t[1]) for t in totals) == int(header.group(2))


def test_scalar_and_uneven_all_reduce_bytes_count_whole_elements() -> None:
    assert ring_all_reduce_bytes(1, 4, 4) == 8  # a float32 scalar over 4 ranks: 2 x 4 B, not 6
    assert ring_all_reduce_bytes(1024, 4, 4) == 2 * 3 * 1024  # = 2 (n-1)/n S when n divides it
    assert ring_all_reduce_bytes(10, 4, 4) == 2 * (10 - 1) * 4  # chunks 3,3,3,1: all but the smallest
    assert ring_all_reduce_bytes(5, 4, 1) == 0
    text = _mlp({"w1": P(), "b1": P(), "w2": P()}, {"dp": 4})
    assert "local () int64, 16 B" in text  # the loss's token count: 2 x 8 B, not 2 (n-1)/n x 8
    assert human_bytes(2048) == "2.0 KiB"


def test_summary_has_one_line_per_kind_and_axes_per_source_line() -> None:
    params = mlp.init(8, 16, 4)
    pspec = {"w1": P(), "b1": P(), "w2": P()}
    step = sharded(
        mlp.make_step(MLP_OPT),
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(pspec, MLP_OPT.state_specs(pspec), P("dp"), P("dp")),
        out_specs=(pspec, MLP_OPT.state_specs(pspec), P()),
    )
    low = step.lower(params, MLP_OPT.init(params), torch.randn(16, 8), torch.randint(0, 4, (16,)))
    for items in _groups(low.explain(summary=True)).values():
        kinds = [re.match(r"  (\S+ over \S+) x\d+", i).group(1) for i in items]  # type: ignore[union-attr]
        assert len(kinds) == len(set(kinds))


def test_sequence_parallel_activation_gradients_are_not_named_as_weight_gradients():
    """An activation's gradient with as many elements as a weight of its line ((8, 8, 16) and
    the (64, 16) fc weight) was reported as that weight's gradient (ZeRO)."""
    from examples.train_gpt import state_specs

    axes = {"dp": 2, "tp": 2}
    cfg = gpt.Config(layers=1, residual=P("dp", "tp"))
    params = gpt.init(cfg)
    ps = strategy_specs("tp-sp", params, axes)
    ss = state_specs("tp-sp", ps, axes)
    step = sharded(
        make_step(cfg),
        mesh=Mesh(axes, simulate=True),
        in_specs=(ps, ss, P("dp"), P("dp")),
        out_specs=(ps, ss, P()),
    )
    text = step.lower(params, OPT.init(params), *batch(0, cfg)).explain()
    scatters = [line for line in text.splitlines() if "reduce_scatter over tp:" in line and "local (" in line]
    assert len(scatters) == 4 and not any("gradient of params" in line for line in scatters)


def test_a_bias_gradient_reshaped_to_the_parameter_is_named_as_its_gradient():
    """The bias gradient is a keepdim sum (1, 12) viewed to (12,): matched by its size, through
    the view, it is p['b']'s gradient (the activation rule above must not hide it)."""
    import shardspec

    p, x = {"w": torch.randn(12, 8), "b": torch.randn(12)}, torch.randn(64, 8)

    def step(p, x):
        return shardspec.value_and_grad(
            lambda p, x: torch.nn.functional.linear(x, p["w"], p["b"]).pow(2).mean()
        )(p, x)

    spec = {"w": P("dp"), "b": P("dp")}
    s = sharded(step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(spec, P("dp")), out_specs=(P(), spec))
    text = s.lower(p, x).explain()
    assert "reduce_scatter over dp: gradient of p['b']" in text


def test_zero3_linear_weights_are_named_through_views_and_sgd_grads_by_parameter() -> None:
    """F.linear reads w.t(): its ZeRO-3 gather is the parameter's, not "the t result"; a bias
    gradient reshaped and scaled (p - lr * g) is still that bias's gradient."""
    g = torch.Generator().manual_seed(0)
    p = {
        "w1": torch.randn(10, 8, generator=g),
        "b1": torch.randn(10, generator=g),
        "w2": torch.randn(5, 10, generator=g),
    }
    x, y = torch.randn(12, 8, generator=g), torch.randint(0, 5, (12,), generator=g)

    def loss_fn(p, x, y):
        return F.cross_entropy(F.linear(F.gelu(F.linear(x, p["w1"], p["b1"])), p["w2"]), y)

    def step(p, x, y):
        loss, grads = shardspec.value_and_grad(loss_fn)(p, x, y)
        return {k: p[k] - 0.1 * grads[k] for k in p}, loss

    spec = {k: P("dp") for k in p}
    f = sharded(
        step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(spec, P("dp"), P("dp")), out_specs=(spec, P())
    )
    text = f.lower(p, x, y).explain()
    assert "all_gather over dp: p['w1'] (via t)" in text and "the t result" not in text
    for name in p:
        assert f"reduce_scatter over dp: gradient of p['{name}']" in text
