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
