"""Cases found in review: each once gave a wrong answer or an internal error."""

import warnings
from typing import Any

import pytest
import torch

import shardspec
from shardspec import Mesh, P, sharded


def test_replicated_fallback_gathers_tensors_nested_in_list_arguments():
    """x[i] is aten.index.Tensor(x, [i]): the index sits in a list and must be gathered too."""
    mesh = Mesh({"a": 3}, simulate=True)

    def fn(x, i):
        return x[i]

    x, i = torch.randn(5, 4), torch.tensor([4, 0, 2])
    f = sharded(fn, mesh=mesh, in_specs=(P(), P("a")), out_specs=P(), unsupported="replicate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(f(x, i), fn(x, i))


def test_tensors_the_step_closes_over_are_replicated_constants():
    weight = torch.randn(4, 4)

    def fn(x):
        return (x @ weight).relu().sum(0)

    f = sharded(fn, mesh=Mesh({"a": 2}, simulate=True), in_specs=(P("a"),), out_specs=P())
    x = torch.randn(6, 4)
    torch.testing.assert_close(f(x), fn(x))


def test_integer_indexing_with_sharded_tensor_and_index():
    mesh = Mesh({"a": 3, "b": 2}, simulate=True)

    def fn(x, i):
        return (x[i] * 2).sum(-1)

    x = torch.randn(5, 4)
    for xspec, ispec, idx in [
        (P(), P("a"), torch.tensor([4, 0, 2, 1])),
        (P("a", "b"), P(("a", "b")), torch.tensor([4, 0, 2, 1, 3, 3])),
        (P(None, "b"), P("a", None), torch.tensor([[0, 1], [2, 3], [4, 4]])),
    ]:
        f = sharded(fn, mesh=mesh, in_specs=(xspec, ispec), out_specs=P())
        torch.testing.assert_close(f(x, idx), fn(x, idx))


def test_one_value_in_two_operand_slots_of_a_product_is_laid_out_per_slot():
    """``a @ a`` needs ``a`` split by rows on the left and by columns (or whole) on the right; one
    node placed once gave each rank the whole product (a result twice the global size)."""
    import itertools

    import shardspec

    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    a, h, b = torch.randn(4, 4), torch.randn(2, 4, 4), torch.randn(4)
    cases = {
        "a @ a": (lambda a: a @ a, a),
        "mm(a, a) @ a": (lambda a: torch.mm(a, a) @ a, a),
        "addmm(b, a, a)": (lambda a: torch.addmm(b, a, a), a),
        "bmm(h, h)": (lambda h: torch.bmm(h, h), h),
        "baddbmm(h, h, h)": (lambda h: torch.baddbmm(h, h, h), h),
    }
    specs = [P(), P("dp"), P(None, "tp"), P("dp", "tp"), P("tp", "dp")]
    for name, (fn, x) in cases.items():
        want = fn(x)
        for si, so in itertools.product(specs, repeat=2):
            got = sharded(fn, mesh=mesh, in_specs=(si,), out_specs=so)(x)
            assert got.shape == want.shape, (name, si, so)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name} {si} -> {so}")

    def loss(a):
        return (a @ a).square().sum()

    f = sharded(
        shardspec.value_and_grad(loss), mesh=mesh, in_specs=(P("dp", "tp"),), out_specs=(P(), P("dp"))
    )
    got, want = f(a), shardspec.value_and_grad(loss)(a)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_gradient_of_interpolate_under_a_split_batch_uses_this_ranks_input_size():
    """upsample_*_backward takes its input's full size: the global one failed on a rank's block."""
    import torch.nn.functional as F

    import shardspec

    mesh = Mesh({"dp": 2}, simulate=True)
    for mode, shape in (("linear", (4, 3, 5)), ("nearest", (4, 3, 5, 6)), ("bicubic", (4, 3, 5, 6))):

        def loss(x, mode=mode):
            return F.interpolate(x, scale_factor=2, mode=mode).square().sum()

        x = torch.randn(shape)
        f = sharded(shardspec.value_and_grad(loss), mesh=mesh, in_specs=(P("dp"),), out_specs=(P(), P("dp")))
        for got, want in zip(f(x), shardspec.value_and_grad(loss)(x), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reshaping_an_empty_tensor_is_not_refused():
    """Sizes with a 0 give the view rule no products to match: every dim stays whole (no data)."""
    mesh = Mesh({"dp": 2}, simulate=True)
    for shape, new, spec in (((2, 0), (0,), P()), ((2, 0), (0,), P("dp")), ((2, 0, 3), (0, 3), P())):
        x = torch.zeros(shape)
        got = sharded(lambda x, new=new: x.reshape(new) + 1, mesh=mesh, in_specs=(spec,), out_specs=P())(x)
        assert got.shape == new


def test_an_op_without_a_rule_runs_where_its_operands_are_held_whole():
    """Replicated operands: running the op on every rank moves nothing, so it is not refused
    (a custom op, the error check torch.linalg.solve ends with); split ones still are."""
    from shardspec.errors import ShardingError
    from tests._custom_ops import doubled

    mesh = Mesh({"dp": 2}, simulate=True)

    def loss(x):
        return doubled(x).square().sum()

    x = torch.randn(4, 3, 5)
    step = sharded(loss, mesh=mesh, in_specs=(P(),), out_specs=P())
    torch.testing.assert_close(step(x), loss(x))
    split = sharded(loss, mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    try:
        split(x)
        raise AssertionError("a split operand of an op without a rule was not refused")
    except ShardingError as e:
        assert "no sharding rule" in str(e) and "unsupported='replicate'" in str(e)

    a, b = torch.randn(4, 4) + 4 * torch.eye(4), torch.randn(4, 6)

    def solve(a, b):
        return torch.linalg.solve(a, b) * 2

    for unsupported in ("error", "replicate"):  # 'replicate' crashed on the check's missing result
        f = sharded(
            solve, mesh=mesh, in_specs=(P(), P(None, "dp")), out_specs=P(None, "dp"), unsupported=unsupported
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(f(a, b), solve(a, b))


def test_stable_sort_keeps_a_split_of_the_other_dims_and_ties_in_order():
    """sort(stable=True) (dim keyword-only in its schema) has the rule of sort: rows split over
    the mesh are sorted where they lie, with ties kept in input order as unsharded."""
    mesh = Mesh({"a": 2}, simulate=True)
    x = torch.tensor([[3.0, 1.0, 1.0, 2.0, 1.0, 0.0]] * 4)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.sort(x, stable=True, dim=1, descending=True)
        return values, indices

    step = sharded(f, mesh=mesh, in_specs=(P("a", None),), out_specs=(P("a", None), P("a", None)))
    values, indices = step(x)
    expected = f(x)
    assert torch.equal(values, expected[0]) and torch.equal(indices, expected[1])
    assert step.lower(x).cost().collective_count == 0


def _row_parallel(loss_fn: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``loss_fn(a, b)`` and its gradients with ``a @ b``'s contraction split over 2 devices, so
    ``a @ b`` is a pending sum (each device holds a part of every element)."""
    step = sharded(
        lambda a, b: shardspec.value_and_grad(loss_fn)(a, b),
        mesh=Mesh({"a": 2}, simulate=True),
        in_specs=(P(None, "a"), P("a")),
        out_specs=P(),
    )
    loss, grads = step(a, b)
    want_grads, _ = torch.func.grad_and_value(loss_fn)(a, b)  # with respect to a, as ours
    torch.testing.assert_close(grads, want_grads, equal_nan=True)
    return loss


def test_a_narrowing_cast_of_a_pending_sum_casts_the_sum_not_each_part():
    """Parts 1000.25 and -1000 of a sum rounded to bf16 one by one add up to 0, the sum 0.25 rounds
    to 0.25: a cast that loses precision must wait for the reduction."""
    a, b = torch.tensor([[1000.25, 1.0]]), torch.tensor([[1.0], [-1000.0]])
    loss = _row_parallel(lambda a, b: (a @ b).bfloat16().float().sum(), a, b)
    assert loss.item() == 0.25
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(s, generator=g) for s in ((16, 64), (64, 16), (16, 16)))
    loss = _row_parallel(lambda a, b: ((a @ b).bfloat16().float() * c).sum(), a, b)
    assert loss.item() == ((a @ b).bfloat16().float() * c).sum().item()


@pytest.mark.parametrize("scale", ["div0", "mul_inf"])
def test_a_pending_sum_scaled_by_zero_division_or_infinity_is_reduced_first(scale: str):
    """Parts of opposite sign divided by 0 (or times inf) give inf - inf = nan where the sum
    divided by 0 is an infinity: only a finite, nonzero scale may act on the parts."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 6, generator=g), torch.randn(6, 7, generator=g)
    apply = (lambda h: h / 0) if scale == "div0" else (lambda h: h * float("inf"))

    def loss_fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return apply(a @ b).clamp(-1, 1).sum()

    assert _row_parallel(loss_fn, a, b).item() == loss_fn(a, b).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_mean_accumulates_in_fp32_as_torch_does(dtype: torch.dtype):
    """torch's mean of fp16/bf16 sums in fp32 and rounds once: a million 0.1s do not overflow
    fp16, and results are bit-equal; the same when the reduced dim is split."""
    mesh = Mesh({"a": 2}, simulate=True)
    x = torch.full((1_000_000,), 0.1, dtype=dtype)
    for spec in (P(), P("a")):
        assert torch.equal(sharded(torch.mean, mesh=mesh, in_specs=(spec,), out_specs=P())(x), x.mean())
    y = torch.randn(8, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = sharded(lambda y: y.mean(0), mesh=mesh, in_specs=(P("a", None),), out_specs=P())(y)
    assert torch.equal(got, y.mean(0))


def test_an_integer_pending_sum_is_reduced_before_a_float_result_takes_it():
    """An int64 sum split over devices has parts (1000000004 and -1000000000) that fp32 cannot
    hold; dividing, casting, promoting or averaging must see the exact integer sum, and the usual
    accuracy idiom ``(p == t).sum() / n`` must be bit-equal."""
    mesh = Mesh({"dp": 2}, simulate=True)
    x = torch.zeros(4, 2, dtype=torch.int64)
    x[0], x[2] = 1_000_000_004, -1_000_000_000  # dp block 0 sums to the first, block 1 the second
    mask = torch.tensor([True, False])
    cases = {
        "cast": lambda x: x.sum(0).float(),
        "divide": lambda x: x.sum(0) / 2,
        "mean count": lambda x: x.sum() / x.numel(),
        "promote": lambda x: x.sum(0) * torch.ones(2),
        "where": lambda x: torch.where(mask, x.sum(0), 0.5),
        "mean dtype": lambda x: x.sum(0).mean(dtype=torch.float32),
    }
    for name, fn in cases.items():
        got = sharded(fn, mesh=mesh, in_specs=(P("dp"),), out_specs=P())(x)
        assert torch.equal(got, fn(x)), name
    g = torch.Generator().manual_seed(1)
    p, t = torch.randint(0, 3, (12,), generator=g), torch.randint(0, 3, (12,), generator=g)

    def accuracy(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (p == t).sum() / p.numel()

    mesh3 = Mesh({"dp": 3}, simulate=True)
    got = sharded(accuracy, mesh=mesh3, in_specs=(P("dp"), P("dp")), out_specs=P())(p, t)
    assert torch.equal(got, accuracy(p, t))


def test_fp16_pending_sum_is_not_scaled_past_its_range_part_by_part():
    """fp16 parts 1100 and -1099 times 60 overflow one by one (inf - inf); their sum times 60
    does not, and a loss-scaling factor must give the unsharded value."""
    mesh = Mesh({"dp": 2}, simulate=True)
    x = torch.zeros(4, 3, dtype=torch.float16)
    x[0], x[2] = 1100.0, -1099.0  # dp block 0 sums to the first, block 1 the second
    for fn in (lambda x: x.sum(0) * 60, lambda x: x.sum(0) / 0.015625):
        got = sharded(fn, mesh=mesh, in_specs=(P("dp"),), out_specs=P())(x)
        assert torch.equal(got, fn(x))


def test_addmm_with_beta_zero_ignores_its_input_as_torch_does():
    """torch.addmm(input, a, b, beta=0) does not read input: its nan and inf stay out, split or not."""
    g = torch.Generator().manual_seed(0)
    bias = torch.full((4, 5), float("nan"))
    a, b = torch.randn(4, 6, generator=g), torch.randn(6, 5, generator=g)
    mesh = Mesh({"dp": 2}, simulate=True)
    for specs in ((P(), P(), P()), (P("dp"), P("dp"), P()), (P(), P(None, "dp"), P("dp"))):
        got = sharded(
            lambda c, a, b: torch.addmm(c, a, b, beta=0, alpha=2), mesh=mesh, in_specs=specs, out_specs=P()
        )(bias, a, b)
        torch.testing.assert_close(got, torch.addmm(bias, a, b, beta=0, alpha=2))


def test_bitwise_ops_and_shifts_with_python_scalars_have_elementwise_rules():
    """x & 7, x | 3, x ^ 5, x << 2, x >> y, ...: elementwise on a split, bit-equal, nothing moved."""
    mesh = Mesh({"a": 2}, simulate=True)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 1000, (6, 4), generator=g), torch.randint(0, 5, (6, 4), generator=g)
    fns = [
        lambda x, y: (x & 7) + (x | 3) + (x ^ 5),
        lambda x, y: (x << 2) + (x >> 1) + (x << y) + (x >> y),
        lambda x, y: torch.bitwise_left_shift(x, 3) + torch.bitwise_right_shift(x, y),
    ]
    for fn in fns:
        step = sharded(fn, mesh=mesh, in_specs=(P("a"), P("a")), out_specs=P("a"))
        assert torch.equal(step(x, y), fn(x, y))
        assert step.lower(x, y).cost().collective_count == 0


@pytest.mark.parametrize("write", ["column", "rows_scaled", "circular_pad"])
def test_backward_of_slice_writes_runs_on_a_split_batch(write: str):
    """Autograd's backward of a slice assignment (and of circular padding) reads the gradient
    through as_strided: traced as the slices it is, it has rules, with the batch split as in DP."""

    def body(h: torch.Tensor) -> torch.Tensor:
        if write == "column":
            h[:, 0] = 0.0
        elif write == "rows_scaled":
            h[:, 1:3] *= 0.5
        else:
            h = torch.nn.functional.pad(h.unsqueeze(1), (2, 1), mode="circular").squeeze(1)
        return h

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (body(x @ w) ** 2).mean()

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(5, 4, generator=g), torch.randn(8, 5, generator=g)
    step = sharded(
        shardspec.value_and_grad(loss),
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(P(), P("dp")),
        out_specs=(P(), P()),
    )
    got, grad = step(w, x)
    want, want_grad = torch.func.grad_and_value(loss)(w, x)[::-1]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)


@pytest.mark.parametrize("mesh_axes", [{"dp": 2}, {"dp": 2, "tp": 2}])
def test_torch_func_jvp_inside_a_step(mesh_axes):
    """Forward-mode AD asks is_same_size / _has_same_storage_numel of each tangent: shape
    questions answered when tracing (they had no rule, so jvp needed unsupported='replicate')."""

    def f(w: torch.Tensor, x: torch.Tensor) -> Any:
        return torch.func.jvp(lambda w: (x @ w).tanh().sum(), (w,), (torch.ones_like(w),))

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 6, generator=g), torch.randn(8, 4, generator=g)
    wspec = P(None, "tp") if "tp" in mesh_axes else P()
    step = sharded(f, mesh=Mesh(mesh_axes, simulate=True), in_specs=(wspec, P("dp")), out_specs=P())
    for got, want in zip(step(w, x), f(w, x), strict=True):
        torch.testing.assert_close(got, want)


def test_a_program_compiled_under_autocast_is_not_reused_without_it() -> None:
    """Autocast's casts and the default dtype are traced into the program: both key the cache."""
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    step = sharded(
        torch.matmul, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"), P()), out_specs=P("dp")
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert step(a, b).dtype == torch.bfloat16
    torch.testing.assert_close(step(a, b), a @ b)  # fp32 again, not the bf16 program
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert step(a, b).dtype == torch.bfloat16
    ones = sharded(
        lambda u: u + torch.ones(6),
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(P("dp"),),
        out_specs=P("dp"),
    )
    ones(a)
    torch.set_default_dtype(torch.float64)
    try:
        assert ones(a).dtype == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_dict_specs_match_an_ordered_dict_argument_and_result_by_key() -> None:
    from collections import OrderedDict

    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    x = OrderedDict([("b", torch.randn(8, 6)), ("a", torch.randn(8, 6))])
    spec = {"a": P(None, "tp"), "b": P("dp")}
    step = sharded(
        lambda d: OrderedDict([("s", d["a"] + d["b"]), ("a", d["a"])]),
        mesh=mesh,
        in_specs=(spec,),
        out_specs={"a": P(None, "tp"), "s": P("dp")},
    )
    low = step.lower(x)
    assert dict(zip(low.program.traced.in_paths, low.program.in_specs, strict=True)) == {
        "d['b']": P("dp"),
        "d['a']": P(None, "tp"),
    }
    assert list(low.program.out_specs) == [P("dp"), P(None, "tp")]  # s, a: the result's own order
    got = step(x)
    torch.testing.assert_close(got["s"], x["a"] + x["b"])


def test_sharded_on_a_method_binds_self_and_keeps_a_program_per_instance() -> None:
    mesh = Mesh({"dp": 2}, simulate=True)

    class Model:
        def __init__(self, seed: int) -> None:
            self.w = torch.randn(6, 3, generator=torch.Generator().manual_seed(seed))

        @sharded(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    x = torch.randn(8, 6)
    a, b = Model(0), Model(1)
    torch.testing.assert_close(a.forward(x), x @ a.w)
    torch.testing.assert_close(b.forward(x), x @ b.w)  # b's own weights, not a's program
    assert a.forward is a.forward
    import gc
    import weakref

    gone = weakref.ref(a)
    del a
    gc.collect()
    assert gone() is None  # the instance's step does not keep it alive


def test_value_and_grad_takes_keyword_arguments_and_none_leaves_as_torch_func_does() -> None:
    def loss(p: Any, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        b = p["b"]
        return ((x @ p["w"]) * scale).sum() + (0 if b is None else b.sum())

    p, x = {"w": torch.randn(6, 4), "b": None}, torch.randn(8, 6)

    def step(p: Any, x: torch.Tensor) -> Any:
        return shardspec.value_and_grad(loss)(p, x, scale=2.0)

    got = sharded(step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P(), P("dp")), out_specs=P())(p, x)
    g, value = torch.func.grad_and_value(lambda w: loss({"w": w, "b": None}, x, scale=2.0))(p["w"])
    torch.testing.assert_close(got[0], value)
    assert got[1]["b"] is None and list(got[1]) == ["w", "b"]
    torch.testing.assert_close(got[1]["w"], g)


def test_match_specs_names_namedtuple_fields() -> None:
    import collections

    pair = collections.namedtuple("pair", "w b")
    x = torch.ones(4)
    assert shardspec.match_specs(pair(x, x), [(r"^w$", P("dp"))], default=P()) == pair(P("dp"), P())


def test_a_nested_step_called_with_too_few_arguments_says_so() -> None:
    mesh = Mesh({"dp": 2}, simulate=True)
    inner = sharded(lambda a, b: a + b, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp"))
    outer = sharded(lambda z: inner(z), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(
        shardspec.ShardingError, match=r"in_specs has 2 entries but .* called with 1 arguments"
    ):
        outer(torch.ones(4))


def test_a_step_kept_as_a_class_attribute_is_not_bound_and_equal_instances_keep_their_own() -> None:
    import dataclasses

    mesh = Mesh({"dp": 2}, simulate=True)

    def train_step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x @ w

    class Trainer:
        step = sharded(train_step, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P("dp"))

    w, x = torch.randn(6, 3), torch.randn(8, 6)
    torch.testing.assert_close(Trainer().step(w, x), x @ w)

    @dataclasses.dataclass(frozen=True)
    class Layer:
        name: str
        w: torch.Tensor = dataclasses.field(compare=False)

        @sharded(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    a, b = Layer("proj", torch.randn(6, 3)), Layer("proj", torch.randn(6, 3))  # equal, by name
    torch.testing.assert_close(a.forward(x), x @ a.w)
    torch.testing.assert_close(b.forward(x), x @ b.w)


def test_value_and_grad_splits_keyword_batches_into_microbatches() -> None:
    def loss_fn(w: torch.Tensor, x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
        return ((x @ w - y) ** 2).mean()

    w, x, y = torch.randn(6), torch.randn(8, 6), torch.randn(8)
    want = shardspec.value_and_grad(loss_fn)(w, x, y=y)
    step = sharded(
        lambda w, x, y: shardspec.value_and_grad(loss_fn, microbatches=4)(w, x, y=y),
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(P(), P("dp"), P("dp")),
        out_specs=P(),
    )
    got = step(w, x, y)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_a_closed_over_tensor_changed_after_compiling_is_an_error_not_a_stale_value() -> None:
    mesh = Mesh({"dp": 2}, simulate=True)
    w, x = torch.randn(6, 3), torch.randn(8, 6)
    f = sharded(lambda x: x @ w, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
    f(x)
    f(x)  # unchanged: fine
    w.mul_(2)
    with pytest.raises(shardspec.ShardingError, match=r"modified in place after .* compiled"):
        f(x)

    class Model:
        def __init__(self) -> None:
            self.w = torch.randn(6, 3)

        @sharded(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    m = Model()
    m.forward(x)
    m.w = m.w * 2
    with pytest.raises(shardspec.ShardingError, match=r"self\.w was set to another tensor"):
        m.forward(x)


_GLOBAL_W = torch.ones(4)
_CFG = {"scale": torch.tensor(2.0)}


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * _CFG["scale"]


def test_every_place_a_constant_is_read_from_is_checked_not_only_self_w() -> None:
    """Rebinding a global, a dict entry a helper reads, a nested object's attribute, a module's
    parameter (nn.Module or global model), or ``.data =`` on the tensor: each silently gave the
    value from compile time before."""
    global _GLOBAL_W
    mesh = Mesh({"dp": 2}, simulate=True)
    x = torch.ones(4)
    spec = dict(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))

    g = sharded(lambda x: x * _GLOBAL_W, **spec)
    g(x)
    saved, _GLOBAL_W = _GLOBAL_W, torch.full((4,), 3.0)
    try:
        with pytest.raises(shardspec.ShardingError, match=r"_GLOBAL_W was set to another tensor"):
            g(x)
    finally:
        _GLOBAL_W = saved
    g(x)  # back to the compiled tensor: fine
    _GLOBAL_W.data = torch.full((4,), 5.0)
    with pytest.raises(shardspec.ShardingError, match=r"modified in place after"):
        g(x)

    h = sharded(lambda x: _scaled(x), **spec)
    h(x)
    _CFG["scale"] = torch.tensor(5.0)
    with pytest.raises(shardspec.ShardingError, match=r"_CFG\['scale'\] was set to another tensor"):
        h(x)

    class Inner:
        def __init__(self) -> None:
            self.w = torch.ones(4)

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()
            self.lin = torch.nn.Linear(4, 4)

        @sharded(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
        def step(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * self.inner.w)

    xs = torch.ones(2, 4)
    m = Outer()
    m.step(xs)
    m.inner.w = torch.full((4,), 3.0)
    with pytest.raises(shardspec.ShardingError, match=r"self\.inner\.w was set to another tensor"):
        m.step(xs)
    m = Outer()
    m.step(xs)
    m.lin.weight = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(shardspec.ShardingError, match=r"self\.lin\.weight was set to another tensor"):
        m.step(xs)

    model = torch.nn.Linear(4, 4, bias=False)
    f = sharded(lambda x: model(x), **spec)
    f(xs)
    model.weight = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(shardspec.ShardingError, match=r"model\.weight was set to another tensor"):
        f(xs)


def test_replicate_fallback_gathers_keyword_tensors_too() -> None:
    """The CPU attention kernel takes its mask only as a keyword: the replicate fallback gathered the
    positional operands and left the keyword mask as each rank's block, so rank 1 attended with
    rank 0's mask row (silently wrong), or with other shapes crashed in the generated code."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    params = {k: p.detach().clone() for k, p in mha.named_parameters()}
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[0, -3:] = True
    pad[3, -1:] = True

    def f(p: Any, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        kw = {"key_padding_mask": pad, "need_weights": False}
        return torch.func.functional_call(mha, p, (x, x, x), kw)[0]

    for batch in (2, 4):
        x = torch.randn(batch, 6, 8)
        s = sharded(
            f,
            mesh=Mesh({"dp": 2}, simulate=True),
            in_specs=({k: P() for k in params}, P("dp"), P("dp")),
            out_specs=P(),
            unsupported="replicate",
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = s(params, x, pad[:batch])
        torch.testing.assert_close(got, f(params, x, pad[:batch]))


def test_a_users_cat_feeding_an_all_reduce_is_not_taken_for_a_gradient_bucket() -> None:
    """pack_early fills the buckets bucketing packed; it took any cat feeding an in-place
    all-reduce for one, and transformers' DynamicCache (``cat([torch.tensor([]), k], dim=-2)``, a
    legacy empty (0,) piece) under row-parallel specs crashed it with an IndexError."""
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    config = transformers.MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    tok = torch.randint(0, 64, (4, 12))

    def forward(p: Any, tok: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (tok,)).logits.sum()

    specs = {k: (P(None, "tp") if v.ndim == 2 else P()) for k, v in params.items()}
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    s = sharded(forward, mesh=mesh, in_specs=(specs, P("dp")), out_specs=P())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(s(params, tok), forward(params, tok), rtol=1e-5, atol=1e-4)


def test_train_and_eval_modes_get_programs_of_their_own() -> None:
    """``model.eval()`` after compiling in train mode kept the train-mode program (dropout still
    applied), silently: the modules' training flags are now part of the compile-cache key."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    x = torch.randn(4, 8)

    def forward(p: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))

    spec = {k: P() for k in params}
    step = sharded(forward, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(spec, P("dp")), out_specs=P("dp"))
    trained = step(params, x)
    model.eval()
    torch.testing.assert_close(step(params, x), forward(params, x))  # no dropout
    assert not torch.allclose(trained, forward(params, x))
    model.train()
    torch.testing.assert_close(step(params, x), trained)  # the train-mode program again


_T = torch.randn(4, 3)


def test_an_in_place_write_of_an_input_into_a_tensor_made_from_a_constant_runs_as_eager() -> None:
    """Ops on closed-over constants alone run on plain tensors when the trace is functionalized: a
    write of a traced value into their result (``torch.zeros_like(T).add_(x)``, or inside
    ``F.cosine_similarity(x, T)``'s backward) was a PyTorch internal assert."""
    import torch.nn.functional as F

    mesh = Mesh({"a": 2}, simulate=True)
    x = torch.randn(4, 3)
    steps = [
        lambda x: torch.zeros_like(_T).add_(x),
        lambda x: (_T * 2.0).add_(x),
        lambda x: _T.clone().mul_(x),
    ]
    for f in steps:
        torch.testing.assert_close(sharded(f, mesh=mesh, in_specs=(P("a"),), out_specs=P())(x), f(x))

    def g(x: torch.Tensor) -> Any:
        return shardspec.value_and_grad(lambda x: F.cosine_similarity(x, _T, dim=1).sum())(x)

    got, want = sharded(g, mesh=mesh, in_specs=(P("a"),), out_specs=(P(), P("a")))(x), g(x)
    torch.testing.assert_close(got, want)
    with pytest.raises(shardspec.ShardingError, match="modifies in place a tensor the step closes over"):
        sharded(lambda x: _T.add_(x), mesh=mesh, in_specs=(P("a"),), out_specs=P())(x)


class _Tables:
    W = torch.ones(4)


_DEFAULT_W = torch.ones(4)


def _uses_default(x: torch.Tensor, w: torch.Tensor = _DEFAULT_W) -> torch.Tensor:
    return x * w


_HANDLE = torch.ones(4)


def test_constant_places_the_step_reaches_in_other_ways_and_places_it_does_not_read() -> None:
    """Rebinding after ``lower()`` (the snapshot was taken at the first call), through a partial, a
    class attribute or a helper's default was silently stale; ``model.eval()`` under a partial kept
    the train-mode program; a global that only shares a name with an attribute the step reads, or an
    attribute the step never names, was refused; a traced value stored in a module is an error."""
    import functools

    mesh = Mesh({"dp": 2}, simulate=True)
    x = torch.ones(4)
    spec = dict(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))

    w = torch.ones(4)
    s = sharded(lambda x: x * w, **spec)
    s.lower(x)
    w = torch.full((4,), 3.0)
    with pytest.raises(shardspec.ShardingError, match="w was set to another tensor"):
        s(x)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    xs = torch.randn(2, 4)
    s = sharded(functools.partial(lambda x, m: m(x), m=model), **spec)
    s(xs)
    model.eval()
    torch.testing.assert_close(s(xs), model(xs))

    s = sharded(lambda x: x * _Tables.W, **spec)
    s(x)
    _Tables.W = torch.full((4,), 2.0)
    with pytest.raises(shardspec.ShardingError, match=r"_Tables\.W was set to another tensor"):
        s(x)

    s = sharded(lambda x: _uses_default(x), **spec)
    s(x)
    _uses_default.__defaults__ = (torch.full((4,), 2.0),)
    with pytest.raises(shardspec.ShardingError, match="_uses_default's default 0 was set"):
        s(x)

    class Holder:
        def __init__(self) -> None:
            self.w = torch.ones(4)
            self.history = [self.w]

        @sharded(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
        def step(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    global _HANDLE
    h = Holder()
    _HANDLE = h.w  # a handle under a name the step uses only as an attribute (self.w)
    h.step(x)
    h.history = []  # an attribute the step never names
    _HANDLE = None
    torch.testing.assert_close(h.step(x), x)

    class Causal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mask: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.mask is None:
                self.mask = torch.ones(x.shape[-1])
            return x * self.mask

    m = Causal()  # the trace's value in m.mask is put back to what it held before (None)
    torch.testing.assert_close(sharded(lambda x: m(x), **spec)(x), x)
    assert m.mask is None
    torch.testing.assert_close(m(x), x)  # eager afterwards: real values

    class Cache(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.cache = x * 2  # a new attribute: nothing to put back
            return self.cache

    c = Cache()  # an attribute the trace added is removed again
    torch.testing.assert_close(sharded(lambda x: c(x), **spec)(x), x * 2)
    assert not hasattr(c, "cache")


_S = torch.full((4,), 2.0)
_REGISTRY = {"scale": lambda x: x * _S}


class _Scaler:
    table = torch.full((4,), 2.0)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table

    @classmethod
    def of(cls, x: torch.Tensor) -> torch.Tensor:
        return x * cls.table


class _AttrDict(dict):  # type: ignore[type-arg]
    __getattr__ = dict.__getitem__


def test_constants_reached_through_objects_methods_decorators_and_registries() -> None:
    """A second review's misses: an object's methods (scaler.apply reading self.table), a class
    attribute read through an instance or a classmethod, a functools.wraps decorator's own globals,
    a dict of lambdas, getattr with a string, an nn.Module as the step, a model a method reaches
    (Trainer: eval ignored), a model rebound to a new module; out= into a constant was an internal
    assert; a dict-with-attributes config crashed the walk."""
    import functools

    global _S
    mesh = Mesh({"dp": 2}, simulate=True)
    x = torch.ones(4)
    spec = dict(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
    scaler = _Scaler()

    def refused(step: Any, change: Any, match: str) -> None:
        step(x)
        change()
        with pytest.raises(shardspec.ShardingError, match=match):
            step(x)

    refused(
        sharded(lambda x: scaler.apply(x), **spec), lambda: setattr(scaler, "table", x * 5), "scaler.table"
    )
    scaler = _Scaler()
    refused(
        sharded(lambda x: scaler.apply(x), **spec), lambda: setattr(_Scaler, "table", x * 5), "scaler.table"
    )
    refused(
        sharded(lambda x: _Scaler.of(x), **spec), lambda: setattr(_Scaler, "table", x * 3), "_Scaler.table"
    )
    box = _Scaler()
    box.w = torch.ones(4)  # type: ignore[attr-defined]
    name = "w"  # a string the code holds: getattr(box, "w")
    refused(sharded(lambda x: x * getattr(box, "w"), **spec), lambda: setattr(box, name, x * 2), "box.w")  # noqa: B009

    def rebind_s() -> None:
        global _S
        _S = x * 7

    refused(sharded(lambda x: _REGISTRY["scale"](x), **spec), rebind_s, "_S was set")

    def scaled(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(x: torch.Tensor) -> torch.Tensor:
            return fn(x) * _S

        return wrapper

    refused(sharded(scaled(lambda x: x + 1), **spec), rebind_s, "_S was set")

    xs = torch.ones(4, 4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    s = sharded(model, **spec)
    s(xs)
    model.eval()
    torch.testing.assert_close(s(xs), model(xs))

    class Trainer:
        def __init__(self) -> None:
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))

        @sharded(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
        def step(self, x: torch.Tensor) -> torch.Tensor:
            return self.forward(x)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    t = Trainer()
    t.step(xs)
    t.model.eval()
    torch.testing.assert_close(t.step(xs), t.model(xs))

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    params = {k: v.detach() for k, v in net.named_parameters()}
    f = sharded(
        lambda p, x: torch.func.functional_call(net, p, (x,)),
        mesh=mesh,
        in_specs=({k: P() for k in params}, P("dp")),
        out_specs=P("dp"),
    )
    f(params, xs)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).eval()  # rebound
    torch.testing.assert_close(f(params, xs), torch.func.functional_call(net, params, (xs,)))

    sink = torch.zeros(4)
    with pytest.raises(shardspec.ShardingError, match="modifies in place a tensor the step closes over"):
        sharded(lambda x: torch.mul(x, 2, out=sink), **spec)(x)
    cfg = _AttrDict(scale=2.0)
    torch.testing.assert_close(sharded(lambda x: x * cfg.scale, **spec)(x), x * 2)


_SCALE = torch.tensor(1.0)


class _Registry:
    def __init__(self) -> None:
        self._data: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return self.__dict__["_data"][name]  # a KeyError, not an AttributeError

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * _SCALE


class _Slotted:
    __slots__ = ("inner",)

    def __init__(self) -> None:
        self.inner = _Registry()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(x)


def test_constants_behind_getattr_slots_same_named_places_tuples_and_dead_proxies() -> None:
    """A third review's misses: an object whose __getattr__ raises KeyError, an object held in
    __slots__, two roots both called self (or two closures' cells called cache) whose places
    were merged by name, a traced value stored inside a tuple, and a dead weakref.proxy (crashed)."""
    import weakref

    global _SCALE
    mesh = Mesh({"dp": 2}, simulate=True)
    x = torch.ones(4)
    spec = dict(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
    for holder in (_Registry(), _Slotted()):
        call = holder.apply if isinstance(holder, _Registry) else holder.run
        s = sharded(lambda x, call=call: call(x), **spec)
        s(x)
        _SCALE = torch.tensor(5.0)
        with pytest.raises(shardspec.ShardingError, match="_SCALE was set"):
            s(x)
        _SCALE = torch.tensor(1.0)

    class Norm:
        def __init__(self) -> None:
            self.w = torch.tensor(1.0)

        def apply(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    class Model:
        def __init__(self, post: Any) -> None:
            self.w, self.post = torch.tensor(2.0), post

        def run(self, x: torch.Tensor) -> torch.Tensor:
            return self.post(x * self.w)

    norm = Norm()
    s = sharded(Model(norm.apply).run, **spec)
    s(x)
    norm.w = torch.tensor(100.0)
    with pytest.raises(shardspec.ShardingError, match=r"self\.w was set"):
        s(x)

    def make_layer(scale: float) -> Any:
        cache: dict[str, torch.Tensor] = {}

        def layer(x: torch.Tensor) -> torch.Tensor:
            if "mask" not in cache:
                cache["mask"] = torch.ones(4) * scale
            return x * cache["mask"]

        return layer

    l1, l2 = make_layer(1.0), make_layer(2.0)
    l1(x)  # l1's cache filled eagerly, l2's by the trace only: taken out again
    torch.testing.assert_close(sharded(lambda x: l2(l1(x)), **spec)(x), x * 2)
    assert "mask" not in l2.__closure__[0].cell_contents  # type: ignore[index]
    torch.testing.assert_close(l2(x), x * 2)

    class Stats(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stats: tuple[torch.Tensor, ...] = (torch.zeros(()), torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.stats = (x.mean(), x.std())
            return x * 2

    m = Stats()
    torch.testing.assert_close(sharded(lambda x: m(x), **spec)(x), x * 2)
    assert all(type(t) is torch.Tensor for t in m.stats)

    class Owner:
        pass

    class Layer:
        def apply(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    owner, layer = Owner(), Layer()
    layer.owner = weakref.proxy(owner)  # type: ignore[attr-defined]
    del owner
    torch.testing.assert_close(sharded(lambda x: layer.apply(x), **spec)(x), x * 3)


def test_reductions_over_no_dims_and_of_0_dim_pending_sums() -> None:
    """``any``/``all`` with ``dim=()`` reduce nothing (sum/amax with ``[]`` reduce everything), and
    a softmax of a 0-dim value that is still a pending sum takes the sum first: both were refused
    with "no sharding rule"."""
    x = torch.tensor([[0.5, -1.0, 2.0, -3.0], [-1.0, -2.0, -0.5, 4.0]])
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            (x > 0).any(dim=()),
            (x > 3).all(dim=()),
            (x > 0).any(dim=(0, 1)),
            x.amax(dim=()),
            x.sum(dim=()),
            x.sum().softmax(0),
            x.sum().log_softmax(-1),
        )

    for spec in (P(None, "dp"), P("dp", "tp")):
        got = sharded(f, mesh=mesh, in_specs=(spec,), out_specs=P())(x)
        for a, b in zip(got, f(x), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b)


def test_an_integer_mean_raises_as_eager_does() -> None:
    """torch refuses a mean with an integer result; the sharded step used to return a float."""
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 9]])
    mesh = Mesh({"dp": 2}, simulate=True)
    for f in (lambda x: x.mean(1), lambda x: torch.mean(x, 0, dtype=torch.int64)):
        with pytest.raises(RuntimeError, match="could not infer output dtype"):
            f(x)
        with pytest.raises(RuntimeError, match="could not infer output dtype"):
            sharded(f, mesh=mesh, in_specs=(P(None, "dp"),), out_specs=P())(x)


@pytest.mark.parametrize("transposed", [False, True])
def test_conv_bias_gradient_with_output_channels_split_and_the_batch_split(transposed: bool) -> None:
    """convolution_backward takes the bias's size as an argument: each rank's must be its own
    output channels (it was the global count, a shape error in the per-rank program)."""
    import torch.nn.functional as F

    op = F.conv_transpose2d if transposed else F.conv2d
    g = torch.Generator().manual_seed(0)
    w, b, x = (
        torch.randn(4, 4, 3, 3, generator=g),
        torch.randn(4, generator=g),
        torch.randn(2, 4, 5, 5, generator=g),
    )

    def loss(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return op(x, w, b, padding=1).sin().sum()

    def grads(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> Any:
        return shardspec.value_and_grad(loss, argnums=(0, 1))(w, b, x)

    want = grads(w, b, x)
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    w_spec = P(None, "tp") if transposed else P("tp")
    got = sharded(grads, mesh=mesh, in_specs=(w_spec, P("tp"), P("dp")), out_specs=(P(), (w_spec, P("tp"))))(
        w, b, x
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_foreach_ops_run_per_tensor_with_each_layout() -> None:
    """torch._foreach_* (hand-written multi-tensor optimizers, get_total_norm(foreach=True)) had no
    rule; each is traced as its op per tensor, so tensors of different layouts in one list work."""

    def step(a: torch.Tensor, b: torch.Tensor) -> Any:
        x = torch._foreach_mul([a, b], 2.0)
        y = torch._foreach_add(x, [b, a], alpha=0.5)
        z = torch._foreach_lerp(y, [a, b], 0.3)
        w = torch._foreach_addcmul(z, [a, b], [b, a], value=0.1)  # value: keyword-only in addcmul
        torch._foreach_mul_(w, 3.0)
        m = torch._foreach_maximum(w, 0.0)  # maximum takes no Scalar
        norms = torch._foreach_norm(z, 2, dtype=torch.float64)  # dtype: keyword-only in the norm
        torch._foreach_addcdiv_(z, [a, b], [b.exp(), a.exp()], [0.5, -2.0])  # a number per tensor
        c = torch._foreach_addcmul(z, [a, b], [b, a], torch.tensor([0.5, -2.0]))  # numbers in a tensor
        k = torch._foreach_maximum([a.long(), b.long()], 0.5)  # an int tensor with a float: a float
        extra = (c[0], c[1], k[0], k[1])
        return torch.stack(norms), m[0], m[1], torch.nn.utils.get_total_norm([a, b], foreach=True), extra

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    outs = (P(), P("dp"), P(), P(), (P(), P(), P("dp"), P()))
    f = sharded(step, mesh=mesh, in_specs=(P("dp", "tp"), P(None, "dp")), out_specs=outs)
    torch.testing.assert_close(f(a, b), step(a, b))


@pytest.mark.parametrize("spec", [P(), P("dp")])
def test_a_strided_argument_after_a_dense_one_reaches_the_cached_program_dense(spec: P) -> None:
    """The program is cached by shape and compiled for dense blocks: a same-shape argument whose
    last dim is strided (q.mT.contiguous().mT, unbind(-1)) was fed as it was to the flash kernel."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 6, generator=g) for _ in range(3))
    step = sharded(
        F.scaled_dot_product_attention,
        mesh=Mesh({"dp": 2}, simulate=True),
        in_specs=(spec,) * 3,
        out_specs=P(),
    )
    step(q, k, v)
    torch.testing.assert_close(step(q.mT.contiguous().mT, k, v), F.scaled_dot_product_attention(q, k, v))


def test_masked_half_precision_attention_computes_in_fp32_and_checks_the_mask_dtype_as_eager() -> None:
    """A mask sends SDPA to plain ops: in bf16/fp16 they ran in half precision (5-8x eager's error;
    ATen's CPU kernels upcast), an fp32 bias on bf16 scores crashed, and an int64 mask (which eager
    refuses) was added as a bias."""
    import torch.nn.functional as F

    mesh = Mesh({"dp": 2}, simulate=True)
    g = torch.Generator().manual_seed(0)
    q64 = torch.randn(2, 2, 64, 16, generator=g, dtype=torch.float64)
    keep = torch.rand(64, 64, generator=g) > 0.3
    bias = torch.randn(64, 64, generator=g)

    def attend(q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, attn_mask=m)

    f = sharded(attend, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    for dtype in (torch.bfloat16, torch.float16):
        q = q64.to(dtype)
        for mask in (keep, bias, bias.to(dtype)):
            exact = attend(q.double(), mask.double() if mask.is_floating_point() else mask)
            eager_error = (attend(q, mask).double() - exact).abs().max()
            got = f(q, mask)
            assert got.dtype == dtype
            assert (got.double() - exact).abs().max() <= 1.5 * eager_error
    with pytest.raises(RuntimeError, match="Expected attn_mask dtype to be bool or float"):
        f(q64.float(), keep.long())
