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
