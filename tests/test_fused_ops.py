"""Fused kernels kept through tracing (flash attention, layer norm's backward, GELU's backward,
softmax's backward, the AdamW update): the traced step holds the fused node, and the sharded step,
forward and backward, equals the unsharded one for splits over each free factor, even and uneven."""

from __future__ import annotations

from collections import Counter
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F

from examples.models import gpt
from shardspec import Mesh, P, optim, sharded, value_and_grad

aten = torch.ops.aten
DP2 = Mesh({"dp": 2}, simulate=True)
DP2TP2 = Mesh({"dp": 2, "tp": 2}, simulate=True)
DP3 = Mesh({"dp": 3}, simulate=True)


def _gen(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(
        *shape, generator=torch.Generator().manual_seed(seed + sum(shape)), dtype=torch.float64
    )


def _ops(step: Any, *args: Any) -> Counter[str]:
    low = step.lower(*args)
    return Counter(str(n.target) for n in low.program.programs[0].graph.nodes if n.op == "call_function")


def _check(fn: Any, args: tuple[Any, ...], specs: tuple[P, ...], mesh: Mesh, argnums: Any) -> Any:
    vg = value_and_grad(fn, argnums=argnums)
    grads = specs[argnums] if isinstance(argnums, int) else tuple(specs[i] for i in argnums)
    step = sharded(vg, mesh=mesh, in_specs=specs, out_specs=(P(), grads))
    got, want = step(*args), vg(*args)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    return step


def _attention(causal: bool) -> Any:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal).sin().sum()

    return fn


ATTENTION_SPECS = [
    ("batch", DP2, P("dp"), P("dp"), 4),
    ("heads", DP2, P(None, "dp"), P(None, "dp"), 4),
    ("batch_and_heads", DP2TP2, P("dp", "tp"), P("dp", "tp"), 4),
    ("uneven_batch", DP3, P("dp"), P("dp"), 4),
    ("uneven_heads", DP2, P(None, "dp"), P(None, "dp"), 3),
    ("query_seq", DP2, P(None, None, "dp"), P(), 4),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ATTENTION_SPECS, ids=lambda c: c[0])
def test_flash_attention_sharded_equals_unsharded(case: Any, causal: bool) -> None:
    _, mesh, qspec, kvspec, heads = case
    q, k, v = _gen(4, heads, 6, 8), _gen(4, heads, 5, 8, seed=1), _gen(4, heads, 5, 8, seed=2)
    if causal:
        k, v = _gen(4, heads, 6, 8, seed=1), _gen(4, heads, 6, 8, seed=2)
    step = _check(_attention(causal), (q, k, v), (qspec, kvspec, kvspec), mesh, (0, 1, 2))
    ops = _ops(step, q, k, v)
    assert ops["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 1
    assert ops["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] == 1
    assert ops["aten._softmax.default"] == 0  # not the math form


def test_heads_split_attention_moves_nothing() -> None:
    """Batch and heads are free factors: a heads split runs attention and its backward locally."""
    q, k, v = (_gen(2, 4, 6, 8, seed=s) for s in range(3))
    step = _check(
        _attention(True), (q, k, v), (P(None, "tp"),) * 3, Mesh({"tp": 2}, simulate=True), (0, 1, 2)
    )
    kinds = {c.kind for c in step.lower(q, k, v).collectives()}
    assert kinds <= {"all_reduce"}, kinds  # only the scalar loss


def test_attention_with_mask_or_dropout_free_shapes_keeps_the_math_form() -> None:
    """A call the flash kernel does not take as asked (a mask) is traced as math, still sharded."""
    q, k, v = (_gen(2, 2, 4, 8, seed=s) for s in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

    step = _check(fn, (q, k, v), (P("dp"),) * 3, DP2, (0, 1, 2))
    assert _ops(step, q, k, v)["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 0


def test_attention_whose_value_head_size_differs_keeps_the_math_form() -> None:
    """The flash kernel needs one head size for q, k and v; a different v head size runs as math."""
    q, k, v = _gen(2, 2, 4, 8), _gen(2, 2, 4, 8, seed=1), _gen(2, 2, 4, 6, seed=2)
    step = _check(_attention(True), (q, k, v), (P("dp"),) * 3, DP2, (0, 1, 2))
    assert _ops(step, q, k, v)["aten._scaled_dot_product_flash_attention_for_cpu.default"] == 0


def _norm_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(x, (x.shape[-1],), w, b)
    return (F.gelu(h, approximate="tanh") + F.gelu(h)).log_softmax(-1).softmax(-1).square().sum()


@pytest.mark.parametrize(
    "case",
    [
        ("batch", DP2, P("dp")),
        ("uneven_batch", DP3, P("dp")),
        ("seq", DP2, P(None, "dp")),
        ("both", DP2TP2, P("dp", "tp")),
    ],
    ids=lambda c: c[0],
)
def test_layer_norm_gelu_softmax_backward_sharded_equals_unsharded(case: Any) -> None:
    """Layer norm's backward kernel computes the input's gradient only; its weight and bias
    gradients are sums over the split leading dims (pending sums), so the batch stays split."""
    _, mesh, xspec = case
    x, w, b = _gen(4, 6, 8), _gen(8, seed=1), _gen(8, seed=2)
    step = _check(_norm_gelu, (x, w, b), (xspec, P(), P()), mesh, (0, 1, 2))
    ops = _ops(step, x, w, b)
    for name in (
        "native_layer_norm_backward",
        "gelu_backward",
        "_softmax_backward_data",
        "_log_softmax_backward_data",
    ):
        assert ops[f"aten.{name}.default"] >= 1, name
    if mesh is not DP3:  # (sums over an uneven split are planned as gathers, by the sum rule)
        assert "all_gather" not in {c.kind for c in step.lower(x, w, b).collectives()}


def test_layer_norm_without_affine_and_with_two_normalized_dims() -> None:
    x = _gen(4, 3, 5)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (3, 5)).exp().sum()

    _check(fn, (x,), (P("dp"),), DP2, 0)


def test_gpt_step_traces_fused_kernels() -> None:
    """The example GPT's training step keeps every fused kernel and no decomposed chain."""
    cfg = gpt.Config(layers=1)
    params, opt = gpt.init(cfg), optim.adamw(lr=1e-3, eps=1e-6)  # (zero key-bias grad)
    tok = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=torch.Generator().manual_seed(0))

    def train(p: Any, s: Any, tok: torch.Tensor) -> Any:
        loss, grads = value_and_grad(gpt.loss_fn)(p, tok, tok, cfg)
        return (*opt.update(grads, s, p), loss)

    pspec = {k: P() for k in params}
    step = sharded(
        train,
        mesh=DP2,
        in_specs=(pspec, opt.state_specs(pspec), P("dp")),
        out_specs=(pspec, opt.state_specs(pspec), P()),
    )
    state = opt.init(params)
    ops = _ops(step, params, state, tok)
    assert ops["shardspec.adamw.default"] == len(params)
    for name in ("native_layer_norm", "native_layer_norm_backward", "gelu", "gelu_backward"):
        assert ops[f"aten.{name}.default"] >= 1, name
    assert ops["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] == cfg.layers
    assert ops["aten.tanh.default"] == 0 and ops["aten.rsqrt.default"] == 0  # no decomposed GELU / norm
    p1, s1, loss = step(params, state, tok)
    q1, t1, want = train(params, state, tok)
    torch.testing.assert_close(loss, want)
    for a, b in zip(optree.tree_leaves((p1, s1)), optree.tree_leaves((q1, t1)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh", [DP2, DP3], ids=["even", "uneven"])
def test_adamw_node_sharded_equals_unsharded_and_torch(mesh: Mesh) -> None:
    """The fused AdamW node on ZeRO-style split state equals the unsharded update and torch's."""
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    params = {"w": _gen(5, 4), "b": _gen(5, seed=3)}
    grads = {"w": _gen(5, 4, seed=4), "b": _gen(5, seed=5)}
    spec = {"w": P("dp"), "b": P("dp")}
    step = sharded(
        opt.update,
        mesh=mesh,
        in_specs=(spec, opt.state_specs(spec), spec),
        out_specs=(spec, opt.state_specs(spec)),
    )
    state = opt.init(params)
    refs = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    torch_opt = torch.optim.AdamW(list(refs.values()), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        want = opt.update(grads, state, params)
        params, state = step(grads, state, params)
        for a, b in zip(optree.tree_leaves((params, state)), optree.tree_leaves(want), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for k, r in refs.items():
            r.grad = grads[k].clone()
        torch_opt.step()
    for k, r in refs.items():
        torch.testing.assert_close(params[k], r.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["replicated", "column", "row"])
def test_linear_runs_as_addmm_where_the_contraction_is_whole(case: str) -> None:
    """mm + bias on a rank becomes one addmm; a row-parallel (split contraction) linear keeps its
    product pending and adds the bias once, after the reduction, not inside every rank's product."""
    x, w, b = _gen(6, 8), _gen(4, 8, seed=1), _gen(4, seed=2)
    specs = {
        "replicated": (P("dp"), P(), P()),
        "column": (P(), P("dp"), P("dp")),
        "row": (P(None, "dp"), P(None, "dp"), P()),
    }

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, b).tanh().sum()

    step = _check(fn, (x, w, b), specs[case], DP2, (0, 1, 2))
    ops = _ops(step, x, w, b)
    assert ops["aten.addmm.default"] == (0 if case == "row" else 1), ops


BF16_FORMS = {
    "hand_written": lambda x, w, b: x @ w.T + b,  # eager: the product rounded, then the add
    "linear": lambda x, w, b: F.linear(x, w, b),  # eager: one addmm kernel
    "addmm": lambda x, w, b: torch.addmm(b, x, w.T),
}


@pytest.mark.parametrize("mesh", [Mesh({"z": 1}, simulate=True), DP2], ids=["one_device", "dp2"])
@pytest.mark.parametrize("form", list(BF16_FORMS))
def test_matmul_plus_bias_equals_eager_bit_for_bit_in_bf16(mesh: Mesh, form: str) -> None:
    """Only an addmm/linear the user called runs as one addmm: a hand-written ``x @ w + b`` stays
    mm then add, so each form rounds as it does eagerly (in bf16 the two differ visibly)."""
    x, w, b = (_gen(*s, seed=i).bfloat16() for i, s in enumerate([(6, 16), (12, 16), (12,)]))
    fn = BF16_FORMS[form]
    x_spec = P(tuple(mesh.axis_names))
    step = sharded(fn, mesh=mesh, in_specs=(x_spec, P(), P()), out_specs=P())
    want = fn(x, w, b)
    assert torch.equal(step(x, w, b), want)
    fused = _ops(step, x, w, b)["aten.addmm.default"]
    assert fused == (0 if form == "hand_written" else 1)
    if form != "hand_written":  # the check has teeth: the two roundings differ on these inputs
        assert not torch.equal(want, x @ w.T + b)


def test_linear_fuses_through_the_functionalize_replay() -> None:
    """A step with an in-place op is traced twice (the second time under functionalize); the mark
    on linear's add survives the replay, and an in-place hand-written bias add stays unfused."""
    x, w, b = _gen(6, 8), _gen(4, 8, seed=1), _gen(4, seed=2)

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, w, b)
        h.tanh_()
        g = x @ w.T
        g += b
        return h + g.sin()

    step = sharded(fn, mesh=DP2, in_specs=(P("dp"), P(), P()), out_specs=P())
    torch.testing.assert_close(step(x, w, b), fn(x, w, b), rtol=0, atol=0)
    assert _ops(step, x, w, b)["aten.addmm.default"] == 1


def test_attention_on_operands_with_a_strided_last_dim_is_computed_on_dense_rows() -> None:
    """The CPU flash kernel reads each row as dense memory (eager torch takes its math kernel for
    such operands): ``x.mT`` or a permute that moves the head dim gave garbage, even on one device."""
    import shardspec

    g = torch.Generator().manual_seed(0)
    q, x, z = (torch.randn(s, generator=g) for s in ((2, 2, 4, 4), (2, 2, 4, 4), (2, 8, 4, 2)))

    def transposed(q, x):
        return F.scaled_dot_product_attention(q, x.mT, x.mT).square().sum()

    def permuted(z, q):
        y = z.permute(0, 3, 2, 1)
        return F.scaled_dot_product_attention(y, y, y, is_causal=True).square().sum() + 0 * q.sum()

    for fn, args in ((transposed, (q, x)), (permuted, (z, q))):
        vg = shardspec.value_and_grad(fn, argnums=(0, 1))
        want = vg(*args)
        for mesh in (Mesh({"dp": 1}, simulate=True), DP2):
            got = sharded(vg, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())(*args)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            for a, b in zip(got[1], want[1], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_multihead_attention_with_a_padding_mask_keeps_its_split() -> None:
    """nn.MultiheadAttention with a key-padding mask (how nn.TransformerEncoderLayer calls it)
    reaches the CPU flash kernel with the mask as ``attn_mask=``, a keyword: it had no rule, so the
    step was refused (or, with unsupported='replicate', gathered). The mask is now an operand that
    splits with the batch; loss and gradients equal the unsharded step's, and the attention kernels
    move nothing (MHA's own seq-first reshapes of a split batch still gather, as without a mask)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    params = {k: p.detach().clone() for k, p in layer.named_parameters()}
    x = torch.randn(4, 6, 8)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[0, -2:] = True

    def loss(p: Any, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, p, (x,), {"src_key_padding_mask": pad}).square().mean()

    def step(p: Any, x: torch.Tensor, pad: torch.Tensor) -> Any:
        return value_and_grad(loss)(p, x, pad)

    rep = {k: P() for k in params}
    f = sharded(step, mesh=DP2, in_specs=(rep, P("dp"), P("dp")), out_specs=(P(), rep))
    got, want = f(params, x, pad), step(params, x, pad)
    torch.testing.assert_close(got[0], want[0])
    for k in params:
        torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-4, atol=1e-6, msg=k)
    reasons = [c.reason for c in f.lower(params, x, pad).collectives()]
    assert not [r for r in reasons if "flash_attention" in r.split(" (rule")[0]], reasons


def test_attention_with_a_fully_masked_query_row_gives_zeros_not_nan() -> None:
    """torch's attention uses a safe softmax: a query row whose every key is masked (a left-padded
    sequence) attends to nothing, with zero gradients. The math form gave NaN, and a left-padded
    batch trained on a NaN loss."""
    q, k, v = (_gen(2, 2, 4, 8, seed=s) for s in range(3))
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[0, :, 0, :] = False

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().sum()

    _check(fn, (q, k, v), (P("dp"),) * 3, DP2, (0, 1, 2))
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~mask, float("-inf"))

    def fn_add(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive).square().sum()

    _check(fn_add, (q, k, v), (P("dp"),) * 3, DP2, (0, 1, 2))
