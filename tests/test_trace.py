"""compiler.trace: one functional core-ATen graph on global shapes, and the user errors tracing exposes."""

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.decompose import as_slices
from compiler.trace import trace
from shardspec import ShardingError

P0 = {"w1": torch.randn(4, 8), "w2": torch.randn(8, 2)}
X = torch.randn(3, 4)


def loss_fn(params, x):
    h = torch.nn.functional.gelu(x @ params["w1"])
    return (h @ params["w2"]).pow(2).mean()


def step(params, x, lr):
    grads, loss = torch.func.grad_and_value(loss_fn)(params, x)
    return {k: params[k] - lr * grads[k] for k in params}, loss


def test_forward_backward_update_in_one_graph_on_global_shapes():
    traced = trace(step, (P0, X, 0.1))
    assert traced.in_paths == ("params['w1']", "params['w2']", "x")
    assert traced.out_paths == ("result[0]['w1']", "result[0]['w2']", "result[1]")
    assert [t.shape for t in traced.inputs] == [(4, 8), (8, 2), (3, 4)]
    assert [t.shape for t in traced.outputs] == [(4, 8), (8, 2), ()]
    targets = {str(n.target) for n in traced.module.graph.nodes if n.op == "call_function"}
    assert "aten.mm.default" in targets
    assert all(t.startswith("aten.") for t in targets), targets  # decomposed to ATen, no Python ops
    assert not any(t.endswith("_.default") or "copy_" in t for t in targets)  # functional


def test_graph_computes_the_step():
    traced = trace(step, (P0, X, 0.1))
    got = traced.module(P0["w1"], P0["w2"], X)
    want_params, want_loss = step(P0, X, 0.1)
    torch.testing.assert_close(got[0], want_params["w1"])
    torch.testing.assert_close(got[2], want_loss)


def test_inplace_on_intermediates_is_fine():
    def f(x):
        y = x.clone()
        y.mul_(2)
        return y.sum()

    traced = trace(f, (X,))
    torch.testing.assert_close(traced.module(X)[0], (X * 2).sum())


def _msg(fn, args) -> str:
    with pytest.raises(ShardingError) as info:
        trace(fn, args)
    assert "\nFix: " in str(info.value)
    return str(info.value)


def test_data_dependent_control_flow_names_the_line():
    def branchy(x):
        if x.sum() > 0:  # the offending line
            return x
        return -x

    msg = _msg(branchy, (X,))
    assert "read as a Python value" in msg and "test_trace.py" in msg
    assert "if x.sum() > 0:  # the offending line" in msg and "torch.where" in msg


def test_argument_mutation_names_the_argument_and_line():
    def mutating(params, x):
        params["w1"].add_(1.0)  # mutates the caller's weight
        return x.sum()

    msg = _msg(mutating, (P0, X))
    assert "params['w1'] is modified in place" in msg
    assert 'params["w1"].add_(1.0)  # mutates the caller\'s weight' in msg


def test_mutation_through_a_view_names_the_line():
    def through_view(params, x):
        params["w1"][0].zero_()  # writes the caller's weight through a view
        return x.sum()

    msg = _msg(through_view, (P0, X))
    assert "params['w1'] is modified in place" in msg
    assert 'params["w1"][0].zero_()  # writes the caller\'s weight through a view' in msg


def test_mutation_through_detach_names_the_line():
    def through_detach(params, x):
        params["w1"].detach().mul_(2)  # detach shares the storage
        return x.sum()

    msg = _msg(through_detach, (P0, X))
    assert 'params["w1"].detach().mul_(2)  # detach shares the storage' in msg


def test_non_tensor_leaf_and_result():
    assert "params['w1']: a leaf of type object" in _msg(lambda params: params["w1"], ({"w1": object()},))
    assert "result[1]: the step returned a float" in _msg(lambda x: (x, 1.5), (X,))


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad.mul(2)  # a torch call inside backward


def test_backward_ops_are_labelled_with_the_forward_line_that_caused_them():
    """Each backward op records "backward of <line>" of the forward call whose autograd node ran
    it, torch calls inside an autograd.Function's backward included; forward ops their own line."""
    from compiler.sources import source_of
    from shardspec import value_and_grad

    def loss(w, x):
        h = torch.tanh(x @ w)  # LINE tanh
        return _Doubled.apply(h).sum()  # LINE doubled

    def grad_step(w, x):
        return value_and_grad(loss)(w, x)

    graph = trace(grad_step, (torch.randn(4, 3), X)).module.graph
    aten = torch.ops.aten
    labels: dict = {}
    for n in graph.nodes:
        if n.op == "call_function":
            labels.setdefault(n.target, []).append(source_of(n))
    tanh = labels[aten.tanh.default][0]
    assert tanh.endswith("# LINE tanh")
    assert labels[aten.tanh_backward.default] == ["backward of " + tanh]
    forward_mul, backward_mul = labels[aten.mul.Tensor]
    assert forward_mul.endswith("# LINE doubled")
    assert backward_mul == "backward of " + forward_mul  # not the line inside _Doubled.backward
    assert labels[aten.mm.default][-1].startswith("backward of ")  # the weight's gradient


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_as_strided_slicings_are_recognised_exactly(data: Any) -> None:
    """Autograd reads a written slice back through as_strided; tracing rewrites it as the slices
    it is. Any slicing (steps, selects, size-1 dims) of a contiguous tensor is recognised and
    reproduces as_strided's values; a transposed view is not a slicing and is left alone."""
    shape = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    x = torch.arange(math.prod(shape)).reshape(shape)
    view = x
    for d, n in enumerate(shape):
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        view = view[(slice(None),) * d + (slice(a, b, data.draw(st.integers(1, 3))),)]
    if view.dim() and data.draw(st.booleans()):
        view = view.select(data.draw(st.integers(0, view.dim() - 1)), 0)
    size, stride, offset = list(view.shape), list(view.stride()), view.storage_offset()
    ops = as_slices(shape, size, stride, offset)
    assert ops is not None
    got = x
    for d, a, b, s in ops:
        got = got[(slice(None),) * d + (slice(a, b, s),)]
    assert torch.equal(got.reshape(size), torch.as_strided(x, size, stride, offset))
    if len(shape) == 2 and min(shape) > 1:
        assert as_slices(shape, shape[::-1], [1, shape[1]], 0) is None


@pytest.mark.parametrize("case", ["transposed", "past_the_view"])
def test_as_strided_on_memory_beyond_the_tensor_is_refused(case: str) -> None:
    """as_strided reads storage: on a transposed view, or past a view into its base, the values a
    traced step holds are not that storage, so it is an error naming the line, not a wrong result."""
    from shardspec import Mesh, P, sharded

    def f(x: torch.Tensor) -> torch.Tensor:
        if case == "transposed":
            return torch.as_strided((x + 0.5).transpose(1, 2), (4, 3, 4), (48, 16, 2), 1)
        return torch.as_strided((x + 0.5)[0, :2], (3, 8), (8, 1), 0)  # 3 rows of a 2-row view

    step = sharded(f, mesh=Mesh({"dp": 1}, simulate=True), in_specs=(P(),), out_specs=P())
    with pytest.raises(ShardingError, match=r"(?s)as_strided at .*test_trace.py.*\.contiguous\(\)"):
        step(torch.randn(4, 6, 8))
