"""Bad input to @sharded: a ShardingError naming the argument path, the spec, the sizes and the fix."""

import warnings

import pytest
import torch

import shardspec
from examples.models import mlp
from shardspec import Mesh, P, ShardingError, constrain, optim, sharded
from tests._custom_ops import doubled

MESH = Mesh({"dp": 2, "tp": 2}, simulate=True)
OPT = optim.sgd(lr=0.1)
STEP = mlp.make_step(OPT)
PARAMS = mlp.init(4, 8, 3)
X, Y = torch.randn(4, 4), torch.randint(0, 3, (4,))


def _err(fn, *args) -> str:
    with pytest.raises(ShardingError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\nFix: " in msg, msg
    return msg


REPLICATED_OUT = (P(), {}, P())


def _call(in_specs, out_specs=REPLICATED_OUT):
    return sharded(STEP, mesh=MESH, in_specs=in_specs, out_specs=out_specs)(PARAMS, {}, X, Y)


def test_spec_tree_does_not_match_argument_tree():
    msg = _err(_call, ({"w1": P(), "w2": P()}, {}, P("dp"), P("dp")))
    assert "in_specs does not match" in msg and "prefix" in msg


def test_wrong_number_of_argument_specs():
    msg = _err(_call, (P(), P("dp")))
    assert "in_specs has 2 entries" in msg and "4 arguments" in msg and "params, state, x, y" in msg


def test_split_spec_on_a_python_scalar():
    def step(params, lr):
        return {k: v * lr for k, v in params.items()}

    msg = _err(lambda: sharded(step, mesh=MESH, in_specs=(P(), P("dp")), out_specs=P())(PARAMS, 0.5))
    assert "lr is a Python float (0.5)" in msg and "P('dp')" in msg and "use P() for lr" in msg


def test_spec_longer_than_the_argument_rank():
    msg = _err(_call, (P(), {}, P("dp", None, "tp"), P("dp")))
    assert "x: spec P('dp', None, 'tp') has 3 entries" in msg and "shape (4, 4)" in msg


def test_unknown_axis_in_an_argument_spec():
    msg = _err(_call, ({"w1": P("mp"), "b1": P(), "w2": P()}, {}, P(), P()))
    assert "params['w1']" in msg and "'mp'" in msg and "['dp', 'tp']" in msg


def test_result_spec_tree_mismatch():
    msg = _err(_call, (P(), {}, P(), P()), (P(), P()))
    assert "out_specs does not match" in msg


def test_result_spec_longer_than_result_rank():
    msg = _err(_call, (P(), {}, P(), P()), (P(), {}, P("dp")))
    assert "result[2]: spec P('dp') has 1 entries" in msg and "P() for a scalar" in msg


def test_spec_that_is_not_a_partition_spec():
    msg = _err(_call, (P(), {}, "dp", P()))
    assert "in_specs for x is 'dp', not a P" in msg


def test_missing_rule_names_the_op_and_line_and_the_fallback_warns():
    def step(x):
        return doubled(x).sum()  # a user's custom op: no rule

    msg = _err(lambda: sharded(step, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(X))
    assert "no sharding rule for shardspec_tests.doubled" in msg and "doubled(x).sum()" in msg
    assert "unsupported='replicate'" in msg
    f = sharded(step, mesh=MESH, in_specs=(P("dp"),), out_specs=P(), unsupported="replicate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(f(X), step(X))
    assert any("no sharding rule for shardspec_tests.doubled" in str(w.message) for w in caught)


def test_data_dependent_control_flow():
    def step(x):
        if x.sum() > 0:  # branch on a value
            return x * 2
        return x

    msg = _err(lambda: sharded(step, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))(X))
    assert "if x.sum() > 0:  # branch on a value" in msg and "torch.where" in msg


@pytest.mark.parametrize("read", ["numpy", "tolist"])
def test_reading_values_out_of_a_traced_tensor_names_the_line(read):
    def step(x):
        return x * float(getattr(x, read)()[0][0])  # reads a value

    msg = _err(lambda: sharded(step, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))(X))
    assert "# reads a value" in msg and "traced once on shapes" in msg


def test_argument_mutation():
    def step(params, x):
        params["w1"].mul_(0.5)  # in place on an argument
        return x.sum()

    msg = _err(lambda: sharded(step, mesh=MESH, in_specs=(P(), P()), out_specs=P())(PARAMS, X))
    assert "params['w1'] is modified in place" in msg and "mul_(0.5)" in msg


def test_unknown_axis_in_a_constraint():
    def step(x):
        return constrain(x * 2, P("sp")).sum()  # the mesh has no 'sp'

    msg = _err(lambda: sharded(step, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(X))
    assert "constrain at" in msg and 'constrain(x * 2, P("sp"))' in msg and "'sp'" in msg


def test_bad_mesh_and_option():
    assert "needs a shardspec.Mesh" in _err(lambda: sharded(STEP, mesh="dp", in_specs=(), out_specs=()))
    assert "unsupported='gather'" in _err(
        lambda: sharded(STEP, mesh=MESH, in_specs=(), out_specs=(), unsupported="gather")
    )


def test_microbatches_must_divide_the_batch():
    def step(w, x):
        loss, g = shardspec.value_and_grad(lambda w, x: (x @ w).sum(), microbatches=3)(w, x)
        return w - g, loss

    msg = _err(
        lambda: sharded(step, mesh=MESH, in_specs=(P(), P("dp")), out_specs=(P(), P()))(torch.randn(4, 2), X)
    )
    assert "does not split into 3 microbatches" in msg and "(4, 4)" in msg


def test_nested_step_with_a_bad_in_spec_names_that_step_not_a_constrain():
    mesh = Mesh({"dp": 2}, simulate=True)

    def inner_step(x):
        return x * 2

    inner = sharded(inner_step, mesh=mesh, in_specs=(P("tp"),), out_specs=P("dp"))
    outer = sharded(lambda x: inner(x) + 1, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(ShardingError, match=r"^inner_step: x: spec P\('tp'\) names mesh axis 'tp'"):
        outer(torch.randn(4, 3))


def test_a_shape_mistake_inside_the_step_names_its_line_without_a_logged_traceback(caplog):
    """torch's own error on fake tensors (a matmul of mismatched shapes) is raised as it is, with a
    note naming the user's line; fake-tensor propagation's ERROR log of it (a screenful of torch
    internals on stderr) is not emitted."""
    import logging

    def step(q):
        return q @ torch.ones(3, 3)

    f = sharded(step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"),), out_specs=P("dp"))
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as info:
        f(torch.randn(4, 8))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "raised while tracing step" in notes and "return q @ torch.ones(3, 3)" in notes, notes
    assert not [r for r in caplog.records if "fake_tensor" in r.name], caplog.records


def test_a_named_tuple_result_under_a_plain_tuple_spec_says_what_matches_it():
    """``x.topk(2)`` returns ``torch.return_types.topk``: a plain tuple of specs does not match it,
    and the error names the three spellings that do (one of which is then checked to work)."""
    mesh = Mesh({"dp": 2}, simulate=True)
    f = sharded(lambda x: x.topk(2), mesh=mesh, in_specs=(P("dp"),), out_specs=(P("dp"), P("dp")))
    with pytest.raises(ShardingError, match=r"the value a topk \(a named tuple of 2: give one P") as info:
        f(torch.randn(4, 5))
    assert "torch.return_types.topk((P(...), P(...)))" in str(info.value)
    spec = torch.return_types.topk((P("dp"), P("dp")))
    x = torch.randn(4, 5)
    got = sharded(lambda x: x.topk(2), mesh=mesh, in_specs=(P("dp"),), out_specs=spec)(x)
    assert type(got) is torch.return_types.topk and torch.equal(got.values, x.topk(2).values)


def test_a_library_collective_in_a_steps_loss_is_refused_at_its_line_under_value_and_grad():
    """Under value_and_grad, torch.func failed first on the op's missing derivative (an internal
    error about autograd.Function); the documented error comes at the call, with the mesh's own
    axis in the fix."""
    import collectives
    import shardspec

    mesh = Mesh({"ep": 2}, simulate=True)

    def loss_fn(w, x):
        return collectives.all_reduce(x @ w, axis="ep", mesh=mesh).sum()

    for step in (lambda w, x: shardspec.value_and_grad(loss_fn)(w, x)[0], loss_fn):
        f = sharded(step, mesh=mesh, in_specs=(P(), P("ep")), out_specs=P())
        with pytest.raises(ShardingError, match=r"own collectives, called inside a sharded step") as info:
            f(torch.randn(3, 3), torch.randn(4, 3))
        assert "return collectives.all_reduce(x @ w" in str(info.value)
        assert "constrain(x, P('ep'))" in str(info.value)
