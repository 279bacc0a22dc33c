"""optim.adamw's defaults are torch.optim.AdamW's, and its steps match torch's."""

import inspect

import pytest
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


def test_an_sgd_momentum_passed_as_a_tensor_matches_the_float_one_inside_the_step():
    """Whether the state holds a momentum buffer is decided without reading the tensor's value
    (inside a step that read is an error)."""
    from shardspec import Mesh, P, sharded

    params, grads = {"w": torch.randn(4, 3)}, {"w": torch.randn(4, 3)}
    buf = {"w": torch.randn(4, 3)}

    def step(p, g, b, momentum):
        return optim.sgd(lr=0.1, momentum=momentum).update(g, {"momentum": b}, p)

    f = sharded(
        step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=(P("dp"),) * 3 + (P(),), out_specs=P("dp")
    )
    for m in (0.9, 0.0):
        got = f(params, grads, buf, torch.tensor(m))
        want = optim.sgd(lr=0.1, momentum=m).update(grads, {"momentum": buf} if m else {}, params)
        torch.testing.assert_close(got[0]["w"], want[0]["w"])
        torch.testing.assert_close(got[1]["momentum"]["w"], m * buf["w"] + grads["w"])
    assert optim.sgd(lr=0.1, momentum=torch.tensor(0.0)).state_specs({"w": P()}) == {"momentum": {"w": P()}}


def test_an_adamw_learning_rate_passed_as_a_tensor_matches_the_float_one_with_and_without_donation():
    """The one-node update takes a float lr; a tensor lr (a schedule's value) takes the same formula
    in plain ops (another rounding order: equal within a few float32 ulps), traced once for every
    value."""
    from shardspec import Mesh, P, sharded

    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(2)]
    specs = {k: P() for k in params}
    sspecs = optim.adamw().state_specs(specs)
    for donate in ((), (0, 1)):

        def step(p, s, gr, lr):
            return optim.adamw(lr=lr, weight_decay=0.01).update(gr, s, p)

        f = sharded(
            step,
            mesh=Mesh({"dp": 2}, simulate=True),
            in_specs=(specs, sspecs, specs, P()),
            out_specs=(specs, sspecs),
            donate=donate,
        )
        p = {k: v.clone() for k, v in params.items()}
        s, ref_p, ref_s = optim.adamw().init(p), dict(params), optim.adamw().init(params)
        for lr, gr in zip((1e-2, 3e-2), grads, strict=True):
            p, s = f(p, s, gr, torch.tensor(lr))
            ref_p, ref_s = optim.adamw(lr=lr, weight_decay=0.01).update(gr, ref_s, ref_p)
        for k in params:
            torch.testing.assert_close(p[k], ref_p[k], rtol=1e-5, atol=1e-6)
        assert len(f._cache) == 1


def test_adamw_refuses_mixed_dtypes_inside_a_step_as_eagerly_and_takes_a_tensor_weight_decay():
    """A bf16 parameter with fp32 gradient or state was silently promoted to fp32 inside a step
    (eager torch refuses); a tensor weight decay reached a Python branch on its value."""
    import pytest

    from shardspec import Mesh, P, ShardingError, sharded

    mesh = Mesh({"dp": 2}, simulate=True)
    p = {"w": torch.randn(4, 3)}
    g = {"w": torch.randn(4, 3)}

    def step(p, s, g, wd):
        return optim.adamw(lr=1e-2, weight_decay=wd).update(g, s, p)

    s = optim.adamw().init(p)
    f = sharded(step, mesh=mesh, in_specs=(P(), P(), P(), P()), out_specs=(P(), P()))
    got, _ = f(p, s, g, torch.tensor(0.1))
    want, _ = optim.adamw(lr=1e-2, weight_decay=0.1).update(g, s, p)
    torch.testing.assert_close(got["w"], want["w"], rtol=1e-5, atol=1e-6)

    bf = {"w": p["w"].bfloat16()}
    for grads, state in ((g, optim.adamw().init(bf)), ({"w": g["w"].bfloat16()}, s)):
        with pytest.raises(ShardingError, match="refuses mixed dtypes"):
            f(bf, state, grads, 0.1)


def test_grads_or_state_of_another_tree_name_the_missing_leaves():
    """A gradient tree missing a parameter, or state built for other parameters, was optree's
    ValueError printing the fake tensors."""
    from shardspec import Mesh, P, ShardingError, sharded

    params = {"w": torch.randn(4), "b": torch.randn(2)}
    mesh = Mesh({"a": 2}, simulate=True)
    for opt in (optim.sgd(0.1), optim.sgd(0.1, momentum=0.9), optim.adamw(0.1)):
        step = sharded(
            lambda p, s, opt=opt: opt.update({"w": p["w"] * 2}, s, p),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=P(),
        )
        with pytest.raises(
            ShardingError, match=r"grads does not have the parameters' tree structure.*\['b'\]"
        ):
            step(params, opt.init(params))
        if opt.init(params):  # a state: built for another tree
            with pytest.raises(ShardingError, match=r"state\['(m|momentum)'\] does not have.*\['b'\]"):
                opt.update(params, opt.init({"w": params["w"]}), params)
