"""Compile-time properties that keep ``lower()`` fast on deep models, checked by counting work (not
by timing, which a loaded machine would make flaky), plus a bounded run of the benchmark script."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from benchmarks import compile_time
from compiler import passes
from compiler import propagate as prop
from compiler.passes import graph as graph_module
from compiler.passes.graph import annotate
from compiler.passes.pack_early import best_start
from compiler.reshard import plan
from compiler.sharding import Sharding
from compiler.trace import trace
from examples.models import gpt
from shardspec import Mesh, P, sharded

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
    assert "aten.unbind.int" in targets  # q, k, v: one multi-output view, not a select each


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


def _rank_program(layers: int, devices: int, monkeypatch: Any) -> tuple[Any, Any]:
    """Rank 0's program of a GPT step as the passes receive it, and its input shapes."""
    seen: dict[str, Any] = {}
    original = passes.optimize

    def keep(gm: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.setdefault("program", (gm, inputs))
        return original(gm, inputs, *args, **kwargs)

    monkeypatch.setattr(passes, "optimize", keep)
    _, args, f = compile_time.gpt_step(gpt.Config(layers=layers, **SMALL), devices)
    f.lower(*args)
    return seen["program"]


def _described(gm: Any) -> list[Any]:
    """Every node's value as the passes read it: shape, stride, offset, dtype, device, and which
    earlier node's value shares its storage (the memory report's view-or-copy test)."""
    storages: dict[int, str] = {}
    out = []
    for n in gm.graph.nodes:
        vals = n.meta.get("val")
        for i, v in enumerate(vals if isinstance(vals, (tuple, list)) else [vals]):
            if isinstance(v, torch.Tensor):
                owner = storages.setdefault(v.untyped_storage()._cdata, f"{n.name}[{i}]")
                out.append((n.name, i, v.shape, v.stride(), v.storage_offset(), v.dtype, v.device, owner))
            else:
                out.append((n.name, i, v))
    return out


def test_meta_annotation_equals_fake_tensor_propagation(monkeypatch: Any) -> None:
    """The passes' shape propagation runs meta kernels without the fake-tensor layer (about half
    the time): every value, layout and storage sharing it gives equals fake propagation's."""
    gm, inputs = _rank_program(2, 2, monkeypatch)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(torch.empty(tuple(s), dtype=d)) for s, d in inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    want = _described(gm)
    for n in gm.graph.nodes:
        n.meta.pop("val", None)
    annotate(gm, inputs)
    assert _described(gm) == want
    assert all(isinstance(n.meta["val"], torch.Tensor) for n in gm.graph.nodes if n.op == "placeholder")


def test_annotation_falls_back_to_fake_propagation(monkeypatch: Any) -> None:
    """An op that fails on meta tensors (no meta kernel) gets the fake-tensor values instead."""
    gm, inputs = _rank_program(1, 2, monkeypatch)
    annotate(gm, inputs)
    want = _described(gm)

    def no_meta_kernel(*args: Any) -> None:
        raise NotImplementedError("no meta kernel")

    monkeypatch.setattr(graph_module, "_meta_propagate", no_meta_kernel)
    for n in gm.graph.nodes:
        n.meta.pop("val", None)
    annotate(gm, inputs)
    assert _described(gm) == want


def test_memoized_reshard_plans_are_fresh_lists() -> None:
    mesh = Mesh({"dp": 2, "tp": 2}, simulate=True)
    src, dst = Sharding.of(P("dp"), 2), Sharding.of(P(), 2)
    first = plan((8, 4), torch.float32, src, dst, mesh)
    first.clear()  # a caller changing its list does not change the next answer
    assert [s.kind for s in plan((8, 4), torch.float32, src, dst, mesh)] == ["all_gather"]


@pytest.mark.parametrize("devices", ["2,4"])
def test_compile_time_benchmark_bounded(devices: str) -> None:
    out = compile_time.main(
        ["--layers", "1", "--d", "16", "--seq", "8", "--vocab", "32", "--devices", devices, "--rounds", "2"]
    )
    assert out["make_fx_s"] > 0 and out["make_fx_cpu_s"] > 0 and len(out["rows"]) == 2
    assert out["lower_over_make_fx"] > 0 and out["largest_over_smallest_mesh"] > 0
    assert len(out["runs"]) == 2 and len(out["lower_over_make_fx_per_round"]) == 2
    for r in out["rows"]:
        assert r["trace"] > 0 and r["propagate"] > 0 and r["passes"] > 0 and r["codegen_s"] > 0


def _best_start_by_trying_each(live: list[int], made: list[tuple[int, int]], end: int, total: int) -> int:
    """The buffer's start found by pricing every start against every op (the definition)."""
    best, best_peak = 0, None
    for k, (start, _) in enumerate(made):
        peak = max(max(live[:start], default=0), live[start] + total)
        for t in range(start + 1, end):
            held = sum(b for p, b in made if p <= t)
            peak = max(peak, live[t] - held + total)
        if best_peak is None or peak < best_peak:
            best, best_peak = k, peak
    return best


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_pack_early_start_equals_trying_every_start(data: Any) -> None:
    """The flat buffer's start is chosen in one pass over the program; it must be the start that
    trying every start against every op picks (the lowest peak, the earliest on a tie)."""
    end = data.draw(st.integers(1, 40))
    live = data.draw(st.lists(st.integers(0, 1000), min_size=end + 1, max_size=end + 1))
    positions = sorted(data.draw(st.sets(st.integers(0, end - 1), min_size=1, max_size=end)))
    made = [(p, data.draw(st.integers(0, min(300, live[p])))) for p in positions]
    total = sum(b for _, b in made)
    assert best_start(live, made, end, total) == _best_start_by_trying_each(live, made, end, total)


def test_compiling_pauses_the_cyclic_collector_and_restores_it() -> None:
    """Full collections rescanning the compile's objects cost a third of a deep step's compile:
    compiling pauses the collector (the traced function sees it off), and leaves it as it was."""
    seen: list[bool] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(gc.isenabled())
        return x * 2

    mesh = Mesh({"dp": 2}, simulate=True)
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            sharded(step, mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp")).lower(torch.ones(4))
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    assert seen == [False, False]
