"""optim.adamw's defaults are torch.optim.AdamW's, and its steps match torch's."""

import inspect

import torch

from shardspec import optim


def test_adamw_defaults_are_torch_adamw_defaults():
    ours = inspect.signature(optim.adamw).parameters
    theirs = inspect.signature(torch.optim.AdamW.__init__).parameters
    for name in ("lr", "betas", "eps", "weight_decay"):
        assert ours[name].default == theirs[name].default, name


def test_adamw_default_steps_match_torch():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    opt = optim.adamw()
    params, state = {"w": w.clone()}, opt.init({"w": w})
    ref = torch.nn.Parameter(w.clone())
    torch_opt = torch.optim.AdamW([ref])
    for _ in range(3):
        grad = torch.randn(4, 3, generator=g)
        params, state = opt.update({"w": grad}, state, params)
        ref.grad = grad.clone()
        torch_opt.step()
    torch.testing.assert_close(params["w"], ref.detach(), rtol=1e-6, atol=1e-7)


def test_hyperparameters_may_be_any_number_and_a_string_is_named():
    import numpy as np
    import pytest

    from shardspec import ShardingError

    for lr in (np.float32(1e-3), torch.tensor([1e-3]), torch.tensor(1), 1):
        optim.adamw(lr=lr)
        optim.sgd(lr=lr, momentum=0.9)
    optim.adamw(betas=np.array([0.9, 0.99]))
    with pytest.raises(ShardingError, match=r"lr='3e-4' is not a number"):
        optim.adamw(lr="3e-4")


def test_an_sgd_learning_rate_passed_as_a_tensor_reaches_the_update_inside_the_step():
    from shardspec import Mesh, P, sharded

    params = {"w": torch.randn(4, 3)}
    grads = {"w": torch.randn(4, 3)}

    def step(p, g, lr):
        opt = optim.sgd(lr=lr)
        return opt.update(g, opt.init(p), p)[0]

    f = sharded(step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P(), P(), P()), out_specs=P())
    for lr in (0.1, 0.2):
        got = f(params, grads, torch.tensor(lr))
        torch.testing.assert_close(got["w"], params["w"] - lr * grads["w"])
    assert len(f._cache) == 1
