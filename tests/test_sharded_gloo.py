"""@sharded on 4 gloo processes: each strategy trains 5 steps and matches the single-process run."""

import pytest
import torch

from examples.models import mlp
from shardspec import optim
from shardspec.testing import run_distributed
from tests import _dist_fns as fns
from tests.mlp_strategies import batch

pytestmark = pytest.mark.multiprocess
STEPS = 5


def _reference():
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    step = mlp.make_step(opt)
    params = mlp.init(8, 16, 4)
    state = opt.init(params)
    losses = []
    for i in range(STEPS):
        params, state, loss = step(params, state, *batch(i))
        losses.append(loss)
    return params, losses


@pytest.mark.parametrize("strategy", ["dp", "megatron", "zero3", "dp_x_tp"])
def test_strategy_matches_single_process_for_five_steps(strategy):
    want_params, want_losses = _reference()
    results = run_distributed(fns.train_mlp_steps, 4, args=(strategy, STEPS), timeout=240)
    for r in results:
        for got, want in zip(r["losses"], want_losses, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for k in want_params:
            torch.testing.assert_close(r["params"][k], want_params[k], rtol=1e-5, atol=1e-6)
        assert r["sent"] == r["planned"]  # the backend's byte counter equals the plan, every step
    if strategy == "zero3":
        assert results[0]["local_w1"] == (2, 16)  # parameters stay sharded between steps


def test_real_mode_rejects_inexpressible_uneven_layouts_and_rank_dependent_programs():
    results = run_distributed(fns.uneven_rejected_and_rank_dependent_program, 4, timeout=60)
    for r in results:
        assert "x: spec P(('dp', 'tp')) splits dim 0 of size 6 unevenly over ('dp', 'tp')" in r["uneven"]
        assert "different arguments" in r["signature"] and "[[0], [1, 2, 3]]" in r["signature"]
        assert "ranks compiled different programs" in r["hash"] and "[[0], [1, 2, 3]]" in r["hash"]
