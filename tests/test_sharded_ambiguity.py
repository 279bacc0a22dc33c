"""Where two layouts send the same bytes with different collectives and nothing decides, explain()
says so and strict mode refuses. Ties are rare under the byte model, so the test forces them by
pricing every reshard at zero bytes (collective counts stay real)."""

import pytest
import torch

import compiler.propagate as propagate_module
from compiler.reshard import Step
from examples.models import mlp
from shardspec import Mesh, P, ShardingError, optim, sharded

OPT = optim.adamw(lr=1e-2, weight_decay=0.0)
STEP = mlp.make_step(OPT)
MESH = Mesh({"dp": 2}, simulate=True)
PSPEC = {"w1": P(), "b1": P(), "w2": P()}
SSPEC = OPT.state_specs({"w1": P("dp"), "b1": P("dp"), "w2": P("dp")})


def _free_bytes(steps: list[Step]) -> tuple[float, int]:
    return 0.0, sum(1 for s in steps if s.kind != "slice")


def _args():
    params = mlp.init(4, 8, 3)
    return params, OPT.init(params), torch.randn(4, 4), torch.randint(0, 3, (4,))


def test_ties_are_noted_in_explain_and_refused_in_strict_mode(monkeypatch):
    monkeypatch.setattr(propagate_module, "cost", _free_bytes)
    f = sharded(STEP, mesh=MESH, in_specs=(PSPEC, SSPEC, P("dp"), P("dp")), out_specs=(PSPEC, SSPEC, P()))
    text = f.lower(*_args()).explain()
    assert "note: " in text and "sends the same 0 bytes; chose the first (fewer collectives)" in text
    strict = sharded(
        STEP, mesh=MESH, in_specs=(PSPEC, SSPEC, P("dp"), P("dp")), out_specs=(PSPEC, SSPEC, P()), strict=True
    )
    with pytest.raises(ShardingError, match=r"ambiguous sharding: (.|\n)*constrain"):
        strict.lower(*_args())


def test_standard_plans_have_no_ambiguity():
    f = sharded(
        STEP, mesh=MESH, in_specs=(PSPEC, SSPEC, P("dp"), P("dp")), out_specs=(PSPEC, SSPEC, P()), strict=True
    )
    assert "note:" not in f.lower(*_args()).explain()
