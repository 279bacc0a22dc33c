"""The eager runtime's last rewrites on a real mesh follow the pass options: ``fast_calls`` (tensor
methods for ATen overloads: the same bits) and ``fast_gelu`` (CPU tanh-GELU as ``x * sigmoid(2y)``)
are on by default, each can be turned off, and neither runs where every pass is off."""

from __future__ import annotations

import pytest
import torch

from compiler.passes.fast_gelu import gelu_tanh
from shardspec import Mesh
from shardspec.testing import run_distributed
from tests.test_arena import _make, _run

aten = torch.ops.aten
CASES = {
    "default": None,
    "no_gelu": {"fast_gelu": False},
    "neither": {"fast_gelu": False, "fast_calls": False},
    "no_passes": False,
}


def _targets(gm: torch.fx.GraphModule) -> set[object]:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def _real(rank: int, world: int) -> dict[str, object]:
    mesh = Mesh({"dp": world})
    out: dict[str, object] = {}
    for name, passes in CASES.items():
        f = _make("dp", mesh, passes)
        results = _run(f, 2)
        (plan,) = f._plans.values()
        run, held = _targets(plan.run), _targets(plan.held)
        out[name] = {
            "results": results,
            "is_held": plan.run is plan.held,
            "gelu": "fast"
            if gelu_tanh in run
            else "aten"
            if run & {aten.gelu.default, aten.gelu.out}
            else "none",
            "views_called_as_overloads": aten.view.default in run or aten._unsafe_view.default in run,
            "held_has_views": aten.view.default in held or aten._unsafe_view.default in held,
        }
    return out


@pytest.mark.multiprocess
def test_fast_calls_and_fast_gelu_follow_the_pass_options_on_a_real_mesh() -> None:
    for r in run_distributed(_real, 2, timeout=240):
        default, no_gelu, neither, none = (r[k] for k in CASES)
        assert default["gelu"] == "fast" and not default["views_called_as_overloads"]
        assert default["held_has_views"]  # what fast_calls rewrote was there
        assert no_gelu["gelu"] == "aten" and not no_gelu["views_called_as_overloads"]
        assert neither["is_held"] and neither["gelu"] == "aten" and neither["views_called_as_overloads"]
        assert none["is_held"]
        # method calls are the same ops: the same bits, every parameter, state and loss
        for a, b in zip(no_gelu["results"], neither["results"], strict=True):
            assert torch.equal(a, b)
        # the sigmoid-form GELU differs from ATen's by rounding: the losses agree to it (AdamW
        # would magnify the rounding in updates of near-zero gradients, so not the parameters)
        for a, b in zip(default["results"][-2:], neither["results"][-2:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
