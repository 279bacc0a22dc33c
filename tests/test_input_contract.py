"""The argument contract of a sharded step: cache keys, refused autograd use, nested steps, and on
real (gloo) meshes the cross-rank checks that turn silent wrong answers and hangs into errors."""

from __future__ import annotations

import math

import pytest
import torch

import shardspec
from shardspec import Mesh, P, ShardingError, sharded
from shardspec.testing import run_distributed
from tests import _contract_fns as fns

MESH = Mesh({"dp": 2}, simulate=True)


def _scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


def test_negative_zero_is_not_served_the_program_compiled_for_zero():
    step = sharded(_scale, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))
    x = torch.ones(4)
    assert not torch.signbit(step(x, 0.0)).any()
    assert torch.signbit(step(x, -0.0)).all()


def test_nan_scalar_hits_the_compile_cache():
    step = sharded(_scale, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))
    for _ in range(3):
        assert step(torch.ones(4), math.nan).isnan().all()
    assert len(step._cache) == 1


def test_unhashable_leaf_is_named():
    np = pytest.importorskip("numpy")
    step = sharded(_scale, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))
    with pytest.raises(ShardingError, match=r"s: a leaf of type ndarray is neither a tensor"):
        step(torch.ones(4), np.array([1.0]))


def test_torch_func_grad_through_a_step_is_an_error_not_zero():
    step = sharded(lambda x: (x * x).sum(), mesh=MESH, in_specs=(P("dp"),), out_specs=P())
    with pytest.raises(ShardingError, match=r"(?s)torch.func transform.*value_and_grad"):
        torch.func.grad(step)(torch.ones(4))


def test_autograd_inputs_are_refused_not_silently_dropped():
    step = sharded(lambda x: (x * x).sum(), mesh=MESH, in_specs=(P("dp"),), out_specs=P())
    x = torch.ones(4, requires_grad=True)
    with pytest.raises(ShardingError, match=r"(?s)x requires grad \(shape \(4,\)\).*value_and_grad"):
        step(x)
    with torch.no_grad():
        assert step(x).item() == 4.0


def test_item_in_the_step_is_a_clear_error_also_with_the_replicate_fallback():
    def f(x):
        return x * x.sum().item()

    for unsupported in ("error", "replicate"):
        step = sharded(f, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"), unsupported=unsupported)
        with pytest.raises(
            ShardingError, match=r"(?s)\.item\(\).*test_input_contract.py:\d+.*keep it a tensor"
        ):
            step(torch.ones(4))


def test_in_place_update_of_a_closed_over_tensor_is_a_clear_error():
    buf = torch.zeros(4)

    def f(x):
        buf.add_(x)
        return x * 2

    step = sharded(f, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(
        ShardingError, match=r"modifies in place a tensor the step closes over \(buf, shape \(4,\)\)"
    ):
        step(torch.ones(4))


def test_a_module_buffer_updated_in_place_is_named_with_the_functional_call_fix():
    """Batch norm in train mode updates its running statistics in place: the error names the
    buffer and the way to train it (buffers in and out through functional_call, or eval())."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    step = sharded(lambda x: model(x), mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(
        ShardingError, match=r"(?s)model\.1\.(running_mean|num_batches_tracked).*functional_call"
    ):
        step(torch.randn(8, 4))


def test_nested_step_is_inlined_with_its_specs_as_constraints():
    inner = sharded(lambda y: y * 2, mesh=MESH, in_specs=(P(None, "dp"),), out_specs=P(None, "dp"))
    outer = sharded(lambda x: inner(x) + 1, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    x = torch.randn(4, 6)
    torch.testing.assert_close(outer(x), x * 2 + 1)
    kinds = [c.kind for c in outer.lower(x).collectives()]
    assert "all_to_all" in kinds  # the inner step's spec really pins the layout
    other = sharded(lambda y: y, mesh=Mesh({"tp": 2}, simulate=True), in_specs=(P(),), out_specs=P())
    bad = sharded(lambda x: other(x), mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(ShardingError, match="inside a sharded step on another mesh"):
        bad(x)


def test_dtensor_on_a_simulated_mesh_is_a_clear_error():
    results = run_distributed(_dtensor_on_simulated, 1, timeout=60)
    assert "is a DTensor" in results[0] and "shardspec.to_global(x)" in results[0]


def _dtensor_on_simulated(rank: int, world: int) -> str:
    from torch.distributed.tensor import Replicate, distribute_tensor

    x = distribute_tensor(torch.ones(4), Mesh({"dp": 1}).device_mesh, [Replicate()])
    step = sharded(lambda x: x * 2, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    try:
        step(x)
    except ShardingError as exc:
        return str(exc)
    return "no error"


def test_spec_tree_mismatch_names_the_path_not_the_values():
    step = sharded(lambda p: p["w1"], mesh=MESH, in_specs=({"W1": P()},), out_specs=P())
    with pytest.raises(ShardingError) as info:
        step({"w1": torch.randn(50, 50)})
    text = str(info.value)
    assert "at p: spec keys not in the value: ['W1']; value keys without a spec: ['w1']" in text
    assert "tensor(" not in text and len(text) < 400


def test_in_specs_as_a_list_works_and_a_wrong_count_says_so():
    step = sharded(_scale, mesh=MESH, in_specs=[P("dp"), P()], out_specs=P("dp"))
    torch.testing.assert_close(step(torch.ones(4), 3.0), torch.full((4,), 3.0))
    bad = sharded(_scale, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    with pytest.raises(ShardingError, match=r"in_specs is a P but the step was called with 2 arguments"):
        bad(torch.ones(4), 3.0)


def test_from_local_refuses_simulated_meshes():
    with pytest.raises(ShardingError, match="from_local needs a real mesh"):
        shardspec.from_local(torch.ones(2), P("dp"), MESH)


@pytest.mark.multiprocess
def test_real_mode_contract_turns_silent_errors_and_hangs_into_errors():
    results = run_distributed(fns.contract_checks, 2, timeout=120)
    for rank, r in enumerate(results):
        assert "hold different values on different ranks: x" in r["ddp_habit"], r["ddp_habit"]
        assert "from_local" in r["ddp_habit"]
        torch.testing.assert_close(r["from_local"], r["reference"])
        assert "w (rank groups [[0], [1]])" in r["seeds"], r["seeds"]
        assert "different arguments" in r["scalar"] and "[[0], [1]]" in r["scalar"]
        assert "Differing: scale: ranks [0] 1.0; ranks [1] 2.0." in r["scalar"], r["scalar"]  # named
        assert "DeviceMesh [1, 0]" in r["grid"] and "[0, 1]" in r["grid"], r["grid"]
        assert "names its axes ('dp',)" in r["names"] and "other ranks" not in r["names"], r["names"]
        assert "different arguments" in r["shape"], r["shape"]
        assert "x: ranks [0] a tensor (4, 4)" in r["shape"] and "ranks [1] a tensor (8, 4)" in r["shape"]
        assert "small CPU tensors" in r["tensor_lr"] and "[[0], [1]]" in r["tensor_lr"], r["tensor_lr"]
        assert "ranks [0] a tensor () torch.float32 holding [0.1" in r["tensor_lr"], r["tensor_lr"]
        assert "ranks called different sharded steps" in r["steps"], r["steps"]
        assert "differs between ranks [0, 1], which hold the same block" in r["replica"], r["replica"]
        assert "hold different values on different ranks: x" in r["later_plain"], r["later_plain"]
        assert "a tensor the step closes over" in r["closure"], r["closure"]
        for case in ("closure_scalar", "specs"):
            assert "ranks compiled different programs" in r[case] and "[[0], [1]]" in r[case], r[case]
        assert "which are DTensors" in r["dtensor_or_plain"], r["dtensor_or_plain"]
        want = "rank(s) [1] could not compile" if rank == 0 else "value keys without a spec: ['extra']"
        assert want in r["tree"] and r["tree_s"] < 30, (r["tree"], r["tree_s"])
        if rank == 0:
            assert "did not complete within 2 s" in r["absent"] and "did not call it" in r["absent"]


def test_the_program_digest_text_is_the_same_for_each_ranks_own_gpu():
    """Under NCCL each rank traces on cuda:<local rank>: the text the ranks' digests compare must not
    tell cuda:0 from cuda:1, nor depend on object addresses, yet must see a baked-in value."""
    from compiler.runtime_real import _graph_text

    def graph(device: str, scale: float) -> torch.fx.Graph:
        g = torch.fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(torch.ops.aten._to_copy.default, (x,), {"device": torch.device(device)})
        z = g.call_function(torch.ops.aten.mul.Tensor, (y, scale), {"other_obj": object()})
        g.output(z)
        return g

    assert _graph_text(graph("cuda:0", 0.1)) == _graph_text(graph("cuda:1", 0.1))
    assert _graph_text(graph("cuda:0", 0.1)) != _graph_text(graph("cuda:0", 0.2))


@pytest.mark.multiprocess
@pytest.mark.parametrize("uneven", [False, True])
def test_a_rank_whose_program_raises_leaves_the_others_an_error_not_a_hang(uneven):
    waited, raised = run_distributed(fns.one_rank_raises, 2, args=(uneven,), timeout=60)
    assert "did not complete within 3 s" in waited and "start it again" in waited, waited
    assert "index 99 is out of bounds" in raised, raised


def test_a_step_recompiled_for_every_learning_rate_warns_naming_it():
    step = sharded(_scale, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))
    with pytest.warns(UserWarning, match=r"compiling its 8th program.*values of s differ.*0-dim tensor"):
        for i in range(8):
            step(torch.ones(4), 0.1 * (i + 1))
    for i in range(3):  # as a 0-dim tensor: one program, whatever the value
        step(torch.ones(4), torch.tensor(0.1 * (i + 1)))
    assert len(step._cache) == 9


def test_timeouts_and_bucket_sizes_take_any_number_users_write():
    import numpy as np

    for timeout in (None, float("inf"), np.int64(5), 30):
        sharded(_scale, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"), timeout=timeout)(
            torch.ones(4), 2.0
        )
    for size in (0, 25e6, np.int64(1 << 20), torch.tensor(1000)):
        step = sharded(
            _scale, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"), passes={"bucket_bytes": size}
        )
        assert torch.equal(step(torch.ones(4), 2.0), torch.full((4,), 2.0))


def test_a_step_that_raised_on_one_rank_leaves_the_group_refusing_collectives():
    """After an error inside one rank's program, its peer waits in a collective: calling again, or
    any other collective of the API, must not post one that pairs with it (gloo aborted the process
    on the size mismatch)."""
    r0, r1 = run_distributed(fns.raise_then_call_again, 2, timeout=120)
    assert r1[0].startswith("IndexError") and "can run no further collective" in r1[0]
    assert r0[0].startswith("ShardingError") and "did not complete within 5 s" in r0[0]
    for later in (*r0[1:], *r1[1:]):  # the step again, to_global, from_local, checkpoint save and load
        assert later.startswith("ShardingError") and "cannot run another collective" in later, later
    assert len(r0) == len(r1) == 6


@pytest.mark.multiprocess
def test_a_timed_out_agreement_check_leaves_the_group_unusable():
    r0, _ = run_distributed(fns.late_for_the_agreement_check, 2, timeout=60)
    assert r0[0].startswith("ShardingError") and "did not complete within 1 s" in r0[0], r0[0]
    assert "stays posted" in r0[0]
    assert r0[1].startswith("ShardingError") and "cannot run another collective" in r0[1], r0[1]
    assert r0[1].endswith("(0.0 s)"), r0[1]  # refused at once


def test_an_error_before_a_failed_agreement_check_leaves_the_group_usable():
    r0, r1 = run_distributed(fns.raise_with_different_arguments, 2, timeout=120)
    assert r0[0] == r1[0] == "ok"
    assert r0[1].startswith("ShardingError") and "different arguments" in r0[1]
    assert r1[1].startswith("IndexError")
    assert r0[2] == r1[2] == "ok"
