"""Cases found in review: each once gave a wrong answer or an internal error."""

import warnings

import torch

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
    (circular pad's backward, the error check torch.linalg.solve ends with); split ones still are."""
    import torch.nn.functional as F

    import shardspec
    from shardspec.errors import ShardingError

    mesh = Mesh({"dp": 2}, simulate=True)

    def loss(x):
        return F.pad(x, (1, 2), mode="circular").square().sum()

    x = torch.randn(4, 3, 5)
    step = sharded(shardspec.value_and_grad(loss), mesh=mesh, in_specs=(P(),), out_specs=(P(), P()))
    for got, want in zip(step(x), shardspec.value_and_grad(loss)(x), strict=True):
        torch.testing.assert_close(got, want)
    split = sharded(shardspec.value_and_grad(loss), mesh=mesh, in_specs=(P("dp"),), out_specs=(P(), P("dp")))
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
