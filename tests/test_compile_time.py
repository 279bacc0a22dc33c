"""Compile-time properties that keep ``lower()`` fast on deep models, checked by counting work (not
by timing, which a loaded machine would make flaky), plus a bounded run of the benchmark script."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks import compile_time
from compiler import propagate as prop
from compiler.trace import trace
from examples.models import gpt

SMALL = {"vocab": 32, "seq": 8, "d": 16, "heads": 2}


def _scored(layers: int, devices: int, monkeypatch: Any) -> int:
    """How many sharding candidates propagation scores for a ``layers``-deep GPT step."""
    calls = [0]
    original = prop._Propagator.score

    def counting(self: Any, *args: Any) -> Any:
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(prop._Propagator, "score", counting)
    _, args, f = compile_time.gpt_step(gpt.Config(layers=layers, **SMALL), devices)
    f.lower(*args)
    monkeypatch.setattr(prop._Propagator, "score", original)
    return calls[0]


def test_propagation_work_is_linear_in_depth_and_flat_in_mesh_size(monkeypatch: Any) -> None:
    one, two, three = (_scored(n, 2, monkeypatch) for n in (1, 2, 3))
    assert three - two == two - one > 0  # each identical layer costs the same work
    assert _scored(2, 8, monkeypatch) == two  # a larger mesh of the same axes scores no more


def test_gpt_step_is_traced_once_without_functionalization() -> None:
    """A step with no in-place op and no result aliasing an argument skips the functionalize
    replay (half the trace time): its graph keeps views, not functionalization's copies."""
    step, args, _ = compile_time.gpt_step(gpt.Config(layers=1, **SMALL), 2)
    graph = trace(step, args).module.graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert "aten.view.default" in targets or "aten.reshape.default" in targets
    copies = {f"aten.{v}_copy" for v in ("view", "permute", "t", "transpose", "unsqueeze", "expand")}
    assert not {t.rsplit(".", 1)[0] for t in targets} & copies, targets


def test_in_place_step_is_still_functionalized() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.add_(1)
        return h.t()

    x = torch.randn(3, 4)
    module = trace(step, (x,)).module
    assert not any(
        getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable
        for n in module.graph.nodes
        if n.op == "call_function"
    )
    torch.testing.assert_close(module(x)[0], step(x))


@pytest.mark.parametrize("devices", ["2,4"])
def test_compile_time_benchmark_bounded(devices: str) -> None:
    out = compile_time.main(
        ["--layers", "1", "--d", "16", "--seq", "8", "--vocab", "32", "--devices", devices]
    )
    assert out["make_fx_s"] > 0 and len(out["rows"]) == 2
    assert out["lower_over_make_fx"] > 0 and out["largest_over_smallest_mesh"] > 0
    assert all(r["trace"] > 0 and r["propagate"] > 0 for r in out["rows"])
