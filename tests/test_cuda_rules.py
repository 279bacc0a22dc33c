"""The CUDA attention kernels' rules, checked on fake CUDA tensors (shapes only, no GPU needed).

On CUDA tensors ``scaled_dot_product_attention`` is traced as the memory-efficient kernel
(``compiler/rewrites.py``); its forward and backward must have rules that fit the kernel's real
outputs (lse padded to the kernel's block, 0-dim philox seed and offset, no bias gradient), with
batch and heads free. The whole step on a GPU is run by ``python -m benchmarks.gpu``.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph

from compiler.rules.registry import rule_for

aten = torch.ops.aten


def _node(graph: Graph, target: object, args: tuple[object, ...], val: object) -> torch.fx.Node:
    n = graph.call_function(target, args)  # type: ignore[arg-type]
    n.meta["val"] = val
    return n


def _placeholder(graph: Graph, name: str, val: torch.Tensor) -> torch.fx.Node:
    n = graph.placeholder(name)
    n.meta["val"] = val
    return n


@pytest.mark.parametrize("seq", [64, 50])  # 50: lse is padded past the sequence
@pytest.mark.parametrize("causal", [False, True])
def test_efficient_attention_rules_fit_the_kernel_and_keep_batch_and_heads_free(seq, causal):
    with FakeTensorMode():
        q = torch.empty(2, 4, seq, 32, device="cuda")
        out = aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, causal)
        grads = aten._scaled_dot_product_efficient_attention_backward(
            out[0], q, q, q, None, out[0], out[1], out[2], out[3], 0.0, [True, True, True, False], causal
        )
    g = Graph()
    qn, kn, vn = (_placeholder(g, n, q) for n in "qkv")
    fwd = _node(
        g, aten._scaled_dot_product_efficient_attention.default, (qn, kn, vn, None, True, 0.0, causal), out
    )
    rule, operands = rule_for(fwd)
    assert operands == [qn, kn, vn]
    (lse_seq,) = rule.outputs[1][2]
    assert lse_seq in rule.replicated  # lse's (padded) sequence: its own whole factor
    assert lse_seq not in {f for dims in rule.operands for dim in dims for f in dim}
    o, lse, seed, off = (_placeholder(g, n, t) for n, t in zip(("o", "lse", "seed", "off"), out, strict=True))
    bwd = _node(
        g,
        aten._scaled_dot_product_efficient_attention_backward.default,
        (o, qn, kn, vn, None, o, lse, seed, off, 0.0, [True, True, True, False], causal),
        grads,
    )
    brule, boperands = rule_for(bwd)
    assert boperands == [o, qn, kn, vn, o, lse, seed, off]
    for r in (rule, brule):  # batch and heads pass through every tensor operand
        assert all(t[:2] == (("b",), ("h",)) for t in r.operands if len(t) == 4)
        assert {"b", "h"}.isdisjoint(r.replicated)
