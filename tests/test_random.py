"""Counter-based randomness: dropout masks and torch.rand* values inside a step are the same on every
mesh and spec (bit for bit), depend on the key and the op's trace order, and have the right
distributions; the dropout GPT's step equals the unsharded one bit for bit where no sum is split, and
up to the first split sum where one is (then to float rounding, within the summation bound)."""

from __future__ import annotations

import functools
import re
from typing import Any

import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardspec
from compiler.debug import first_divergence
from examples.models import gpt, gpt_dropout
from examples.train_gpt import OPT, batch, strategy_specs
from shardspec import Mesh, P, sharded
from shardspec.testing import meshes, specs_for

ONE = Mesh({"dp": 1}, simulate=True)


def draws(x: torch.Tensor, key: torch.Tensor) -> dict[str, torch.Tensor]:
    with shardspec.random.rng(key):
        return {
            "dropout": F.dropout(x, 0.3),
            "rand": torch.rand(x.shape),
            "randn_like": torch.randn_like(x),
            "dropout2d": F.dropout2d(x.unsqueeze(-1), 0.5).squeeze(-1) if x.dim() == 2 else x,
        }


@settings(deadline=None, max_examples=12)
@given(mesh=meshes(max_devices=6), data=st.data(), shape=st.sampled_from([(8, 6), (5, 7), (3, 4, 5), (9,)]))
def test_draws_are_identical_on_every_mesh_and_spec(
    mesh: Mesh, data: st.DataObject, shape: tuple[int, ...]
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    key = shardspec.random.key(data.draw(st.integers(0, 2**40)))
    spec = data.draw(specs_for(shape, mesh), label="spec")
    out_spec = data.draw(specs_for(shape, mesh), label="out_spec")
    want = draws(x, key)  # eager, in the same rng scope
    got = sharded(draws, mesh=mesh, in_specs=(spec, P()), out_specs=out_spec)(x, key)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_the_key_and_the_trace_order_decide_the_values() -> None:
    x = torch.ones(64, 64)
    a, b = draws(x, shardspec.random.key(1)), draws(x, shardspec.random.key(2))
    assert not torch.equal(a["dropout"], b["dropout"]) and not torch.equal(a["rand"], b["rand"])
    with shardspec.random.rng(shardspec.random.key(1)):
        first, second = torch.rand(64, 64), torch.rand(64, 64)
    assert not torch.equal(first, second)  # each op its own counter
    assert not torch.equal(
        shardspec.random.fold_in(shardspec.random.key(0), 1),
        shardspec.random.fold_in(shardspec.random.key(0), 2),
    )


def test_without_a_key_a_step_draws_from_the_default_seed() -> None:
    def noise(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape)

    x = torch.zeros(4, 4)
    got = sharded(noise, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"),), out_specs=P())(x)
    with shardspec.random.rng(shardspec.random.DEFAULT_SEED):
        assert torch.equal(got, noise(x))


def test_a_step_called_inside_an_rng_scope_is_told_to_take_the_key() -> None:
    """The compiled program cannot see a surrounding key (each key gave the default draws)."""
    step = sharded(F.dropout, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"),), out_specs=P("dp"))
    with shardspec.random.rng(shardspec.random.key(1)), pytest.raises(shardspec.ShardingError) as info:
        step(torch.ones(4, 4))
    assert "called inside shardspec.random.rng(key)" in str(info.value)
    assert "pass the key to the step" in str(info.value)


def test_distributions() -> None:
    with shardspec.random.rng(shardspec.random.key(3)):
        u = torch.rand(200_000)
        n = torch.randn(200_000)
        kept = (F.dropout(torch.ones(200_000), 0.25) != 0).float()
        scaled = F.dropout(torch.ones(1000), 0.25)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert torch.histc(u, bins=10, min=0, max=1).div(20_000).sub(1).abs().max() < 0.05
    assert abs(float(n.mean())) < 0.01 and abs(float(n.std()) - 1) < 0.01
    assert abs(float(kept.mean()) - 0.75) < 0.005
    assert set(scaled.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}


def _per_token(cfg: gpt.Config) -> object:
    def fn(
        p: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor, key: torch.Tensor
    ) -> torch.Tensor:
        with shardspec.random.rng(key):
            logits = gpt_dropout.forward(p, tokens, cfg, 0.1)
        return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1), reduction="none")

    return fn


# meshes that split the batch (and the parameters, ZeRO-3), so no sum is split: bit for bit
BITWISE = [({"dp": 2}, "dp"), ({"dp": 4}, "zero3"), ({"dp": 2, "sp": 2}, "zero3")]


@pytest.mark.parametrize(("axes", "strategy"), BITWISE, ids=["dp2", "zero3-dp4", "zero3-dp2xsp2"])
def test_dropout_gpt_forward_equals_unsharded_bit_for_bit(axes: dict[str, int], strategy: str) -> None:
    cfg = gpt.Config(layers=1)
    params, (tokens, targets), key = gpt.init(cfg), batch(0, cfg), shardspec.random.key(7)
    want = _per_token(cfg)(params, tokens, targets, key)  # plain torch, in the same rng scope
    pspec = strategy_specs(strategy, params, axes)
    bspec = P(tuple(axes))  # batch over every axis
    got = sharded(
        _per_token(cfg), mesh=Mesh(axes, simulate=True), in_specs=(pspec, bspec, bspec, P()), out_specs=P()
    )(params, tokens, targets, key)
    assert torch.equal(got, want)
    assert not torch.equal(
        want,
        F.cross_entropy(
            gpt.forward(params, tokens, cfg).reshape(-1, cfg.vocab), targets.reshape(-1), reduction="none"
        ),
    )


@pytest.mark.parametrize(
    ("axes", "strategy"), [({"dp": 2}, "dp"), ({"dp": 2, "tp": 2}, "dp-tp"), ({"dp": 2, "tp": 2}, "zero3-tp")]
)
def test_dropout_gpt_training_step_equals_unsharded(axes: dict[str, int], strategy: str) -> None:
    """With split sums (gradients over dp, tensor-parallel contractions) the step equals the
    unsharded one to float rounding, as without dropout; a different mask would differ by far more."""
    cfg = gpt.Config(layers=1)
    params, (tokens, targets) = gpt.init(cfg), batch(0, cfg)

    def step(p: object, s: object, tokens: torch.Tensor, targets: torch.Tensor, key: torch.Tensor) -> object:
        loss, grads = shardspec.value_and_grad(gpt_dropout.loss_fn)(p, tokens, targets, key, cfg)
        p, s = OPT.update(grads, s, p)
        return p, s, loss

    state, key = OPT.init(params), shardspec.random.key(11)
    want_p, _, want_loss = step(params, state, tokens, targets, key)
    pspec = strategy_specs(strategy, params, axes)
    sspec = OPT.state_specs(pspec)
    sharded_step = sharded(
        step,
        mesh=Mesh(axes, simulate=True),
        in_specs=(pspec, sspec, P("dp"), P("dp"), P()),
        out_specs=(pspec, sspec, P()),
    )
    got_p, _, got_loss = sharded_step(params, state, tokens, targets, key)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6)
    _, _, other_loss = step(params, state, tokens, targets, shardspec.random.key(12))
    assert abs(float(other_loss - want_loss)) > 1e-4


def _inplace_dropout(x: torch.Tensor, key: torch.Tensor) -> dict[str, torch.Tensor]:
    with shardspec.random.rng(key):
        h = x * 1.0
        F.dropout(h, 0.5, training=True, inplace=True)  # the result is not used: h itself changes
        g = x * 2.0
        torch.nn.Dropout(0.5, inplace=True)(g)
        return {"functional": h, "module": g}


def test_inplace_dropout_modifies_its_input_as_torch_does() -> None:
    """In-place dropout used as a statement drops from its input (eager torch does), in a step and
    in an eager run under rng, with the mask out-of-place dropout draws at the same position."""
    x, key = torch.ones(8, 8), shardspec.random.key(1)
    torch.manual_seed(0)
    h = x * 1.0
    F.dropout(h, 0.5, True, True)
    assert int((h == 0).sum()) > 0  # what the property is about: torch drops in place
    eager = _inplace_dropout(x, key)
    with shardspec.random.rng(key):
        out_of_place = {"functional": F.dropout(x * 1.0, 0.5), "module": torch.nn.Dropout(0.5)(x * 2.0)}
    step = sharded(
        _inplace_dropout, mesh=Mesh({"a": 2}, simulate=True), in_specs=(P("a"), P()), out_specs=P()
    )
    got = step(x, key)
    for name in eager:
        assert int((eager[name] == 0).sum()) > 0, name
        assert torch.equal(eager[name], out_of_place[name]), name
        assert torch.equal(got[name], eager[name]), name


def _shared_dims(y: torch.Tensor) -> list[int]:
    """The dims along which dropout's result on a tensor of ones never varies (mask dims of size 1)."""
    return [d for d in range(y.dim()) if bool((y == y.narrow(d, 0, 1)).all())]


CHANNEL_CASES = [
    (F.dropout1d, (16, 5)),  # unbatched (C, L): one mask value per channel
    (F.dropout1d, (3, 16, 5)),
    (F.dropout2d, (3, 16, 5)),  # torch reads 3-D as (N, C, L)
    (F.dropout2d, (3, 16, 2, 2)),
    (F.dropout3d, (16, 3, 2, 2)),  # unbatched (C, D, H, W)
    (F.dropout3d, (3, 16, 2, 2, 2)),
]


@pytest.mark.filterwarnings("ignore:dropout2d")
@pytest.mark.parametrize(("fn", "shape"), CHANNEL_CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_channel_dropout_shares_a_mask_over_the_dims_torch_does(fn: object, shape: tuple[int, ...]) -> None:
    assert callable(fn)
    x, key = torch.ones(shape), shardspec.random.key(3)
    torch.manual_seed(0)
    want = _shared_dims(fn(x, 0.5))

    def step(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        with shardspec.random.rng(key):
            return fn(x, 0.5)

    got = sharded(step, mesh=Mesh({"a": 2}, simulate=True), in_specs=(P(None, "a"), P()), out_specs=P())(
        x, key
    )
    assert _shared_dims(got) == want
    assert torch.equal(got, step(x, key))


@pytest.mark.parametrize("p", [-0.25, 1.5])
@pytest.mark.parametrize("fn", [F.dropout, F.dropout1d, F.dropout2d], ids=lambda f: f.__name__)
@pytest.mark.filterwarnings("ignore:dropout2d")
def test_dropout_probability_outside_0_1_is_refused_as_torch_does(fn: object, p: float) -> None:
    """torch raises ValueError for p outside [0, 1]; so does the rewrite (not a silent rescale)."""
    assert callable(fn)

    def drop(x: torch.Tensor) -> torch.Tensor:
        return fn(x, p)  # type: ignore[no-any-return]

    x = torch.ones(4, 4)
    with pytest.raises(ValueError, match="between 0 and 1"):
        drop(x)  # torch itself
    with (
        pytest.raises(ValueError, match=rf"p={p}\) at .*test_random.py:\d+.*between 0 and 1"),
        shardspec.random.rng(0),
    ):
        drop(x)
    step = sharded(drop, mesh=Mesh({"a": 2}, simulate=True), in_specs=(P("a"),), out_specs=P())
    with pytest.raises(shardspec.ShardingError, match=rf"p={p}\) at .*test_random.py:\d+.*between 0 and 1"):
        step(x)


def test_dropout1d_on_an_input_torch_refuses_is_an_error_naming_the_shape() -> None:
    """torch's dropout1d takes 2-D or 3-D inputs only (even in eval mode); the rewrite says so
    instead of picking a mask shape torch would never use."""
    x = torch.ones(2, 3, 4, 5)
    with pytest.raises(RuntimeError, match="dropout1d"):
        F.dropout1d(x, 0.5, training=False)
    step = sharded(lambda x: F.dropout1d(x, 0.5, training=False), mesh=ONE, in_specs=(P(),), out_specs=P())
    with pytest.raises(shardspec.ShardingError, match=r"dropout1d at .*test_random.py:\d+.*\(2, 3, 4, 5\)"):
        step(x)


# --- what is bit for bit in a whole training step, and what only to float rounding ---------------
#
# A float32 sum depends on the order of its additions. A split reduction (the gradient's sum over a
# batch split over dp, a contraction split over tp) adds each device's partial sum and then the
# partial sums, an order the unsharded kernel does not use, so no layout that splits a sum can be
# bit-equal in general (XLA's SPMD partitioner has the same property). Any order of summing n terms
# x_i is within gamma_(n-1) * sum |x_i| of the exact sum (gamma_k = k u / (1 - k u), u = 2^-24), so
# a mean over n values computed in two orders differs by at most 2 gamma_n * mean |x_i|.

U = 2.0**-24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _dropout_step(cfg: gpt.Config) -> Any:
    def step(p: Any, s: Any, tokens: torch.Tensor, targets: torch.Tensor, key: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(gpt_dropout.loss_fn)(p, tokens, targets, key, cfg)
        p, s = OPT.update(grads, s, p)
        return p, s, loss

    return step


CFG = gpt.Config(layers=1)


@functools.cache
def _step_args() -> tuple[Any, ...]:
    params = gpt.init(CFG)
    return (params, OPT.init(params), *batch(0, CFG), shardspec.random.key(11))


def _compiled(axes: dict[str, int], pspec: Any, sspec: Any, bspec: P, **options: Any) -> Any:
    return sharded(
        _dropout_step(CFG),
        mesh=Mesh(axes, simulate=True),
        in_specs=(pspec, sspec, bspec, bspec, P()),
        out_specs=(pspec, sspec, P()),
        **options,
    )


def _replicated(params: dict[str, torch.Tensor]) -> dict[str, P]:
    return {name: P() for name in params}


@functools.cache
def _unsharded_program() -> Any:
    """The step compiled for one device: the same ATen ops as every mesh's program, no split."""
    params = _step_args()[0]
    pspec = _replicated(params)
    return _compiled({"dp": 1}, pspec, OPT.state_specs(pspec), P())(*_step_args())


# optimizer state split over the mesh (ZeRO-1) with parameters and batch replicated: each device
# updates its rows of the moments from the whole gradient, and the parameters are all-gathered
ZERO1_REPLICATED_BATCH = [
    ({"dp": 2}, P("dp")),
    ({"dp": 3}, P("dp")),  # uneven: 16 rows as 6, 5, 5
    ({"dp": 2, "tp": 2}, P(("dp", "tp"))),
]


@pytest.mark.parametrize(("axes", "state_spec"), ZERO1_REPLICATED_BATCH, ids=["dp2", "dp3", "dp2xtp2"])
def test_dropout_gpt_step_is_bit_identical_where_no_sum_is_split(axes: dict[str, int], state_spec: P) -> None:
    """The whole dropout training step (loss, every gradient, AdamW's moments and parameters) equals
    the unsharded program bit for bit on meshes whose splits leave every reduction's order alone:
    the program's only collectives are all-gathers, which move values without adding them.

    The unsharded *program* (this step compiled for one device) is the reference: eager torch
    computes two reductions with other kernels than the traced step, the cross-entropy mean (its
    fused nll_loss, against sum / count) and layer norm's weight and bias gradients (the fused
    backward, against a sum over the leading dims, which a split batch leaves pending), so eager
    differs from every program, the one-device one included, by float rounding: the loss by at most
    the summation bound, the parameters within float32's default tolerance."""
    args = _step_args()
    params = args[0]
    pspec = _replicated(params)
    sspec = OPT.state_specs({name: state_spec for name in params})
    step = _compiled(axes, pspec, sspec, P())
    assert {c.kind for c in step.lower(*args).collectives()} == {"all_gather"}
    got, want = step(*args), _unsharded_program()
    got_leaves, want_leaves = optree.tree_flatten_with_path(got), optree.tree_leaves(want)
    unequal = [path for path, g, w in zip(*got_leaves[:2], want_leaves) if not torch.equal(g, w)]
    assert unequal == [], f"not bit-identical on {axes}: {unequal}"
    eager_p, _, eager_loss = _dropout_step(CFG)(*args)
    with shardspec.random.rng(args[-1]):
        logits = gpt_dropout.forward(params, args[2], CFG, 0.1)
    per_token = F.cross_entropy(logits.reshape(-1, CFG.vocab), args[3].reshape(-1), reduction="none")
    assert abs(float(got[2] - eager_loss)) <= 2 * _gamma(per_token.numel()) * float(per_token.abs().mean())
    torch.testing.assert_close(got[0], eager_p)


SPLIT_SUMS = [({"dp": 2}, "dp"), ({"dp": 2, "tp": 2}, "dp-tp"), ({"tp": 2}, "tp")]


@pytest.mark.parametrize(("axes", "strategy"), SPLIT_SUMS, ids=["dp2", "dp2xtp2", "tp2"])
def test_where_a_sum_is_split_the_first_value_that_differs_is_that_pending_sum(
    axes: dict[str, int], strategy: str
) -> None:
    """On meshes that split sums (the gradients' batch sum over dp, Megatron's contractions over
    tp), every value of the dropout step up to the first split reduction is bit-identical to the
    unsharded program's (dropout masks, embeddings, attention per head, ...): the first value that
    differs at all is a pending sum, whose addition order the split changed. (The in-place
    all-reduce pass is off: it overwrites the addend this comparison reads; values are the same.)"""
    args = _step_args()
    params = args[0]
    pspec = strategy_specs(strategy, params, axes)
    bspec = P("dp") if "dp" in axes else P()
    step = _compiled(axes, pspec, OPT.state_specs(pspec), bspec, passes={"inplace": False})
    first = first_divergence(step.lower(*args).program, args, rtol=0, atol=0)
    assert first is not None and re.search(r"layout [^:]*Partial\(", first), first


@pytest.mark.parametrize(
    "draw",
    [
        lambda x: torch.poisson(x.abs()),
        lambda x: x.clone().cauchy_(),
        lambda x: x.clone().geometric_(0.5),
        lambda x: x.clone().log_normal_(),
        lambda x: x.clone().random_(0, 1000),
        lambda x: torch.nn.init.normal_(x.clone()),
        lambda x: torch.nn.functional.rrelu(x, training=True),
    ],
)
def test_random_ops_without_a_counter_based_form_are_refused(draw: Any) -> None:
    """Each device would draw its own numbers: a replicated value would differ between devices.
    Found by their tag (nondeterministic_seeded), so no op is missed for want of a name in a list."""
    from shardspec import ShardingError

    step = sharded(draw, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P(),), out_specs=P())
    with pytest.raises(ShardingError, match="random numbers inside a sharded step"):
        step(torch.randn(4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_uniform_draws_in_a_narrow_dtype_stay_below_one(dtype: torch.dtype) -> None:
    """24 random bits rounded to bf16 or fp16 could round up to exactly 1.0, outside [0, 1)."""

    def fn(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        with shardspec.random.rng(key):
            return torch.rand_like(x)

    draw = sharded(fn, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"), P()), out_specs=P("dp"))
    u = draw(torch.zeros(1 << 16, dtype=dtype), shardspec.random.key(0))
    assert u.dtype == dtype and float(u.max()) < 1.0 and float(u.min()) >= 0.0


@pytest.mark.parametrize("call", ["default", "explicit", "torch", "module", "in_place", "torch_in_place"])
def test_rrelu_out_of_training_is_its_deterministic_mean_slope(call: str) -> None:
    """rrelu out of training (F.rrelu's default, nn.RReLU in eval mode) draws nothing: it runs as
    leaky_relu with the mean slope, bit-equal to eager, with a split batch."""
    fns = {
        "default": lambda x: F.rrelu(x),
        "explicit": lambda x: F.rrelu(x, 0.1, 0.3, training=False),
        "torch": lambda x: torch.rrelu(x, 0.2, 0.4),
        "module": torch.nn.RReLU(0.05, 0.25).eval(),
        "in_place": lambda x: F.rrelu_(x * 1, 0.1, 0.2),
        "torch_in_place": lambda x: torch.rrelu_(x * 1, 0.1, 0.2),
    }
    fn = fns[call]
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    out = sharded(fn, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"),), out_specs=P("dp"))(x)
    assert torch.equal(out, fn(x))
