"""The one registry of op sharding rules: ATen op -> rule line (or a builder that renders one).

Fixed-arity ops are written as the line itself; shape-polymorphic ops (broadcasting, reductions,
views) name the builder that renders their line from the node's shapes. ``rule_for`` is the only
entry point; a missing op raises ``MissingRule`` for the caller to report with the user's line.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.fx import Node

import compiler.rewrites  # noqa: F401  (defines torch.ops.shardspec.matmul)
from compiler.rules import builders as b
from compiler.rules import structural as st
from compiler.rules.notation import Rule, parse

aten = torch.ops.aten
Builder = Callable[[Node], b.Built]


class MissingRule(KeyError):
    """No sharding rule for an op."""


def fixed(text: str, linear: str) -> Builder:
    def build(node: Node) -> b.Built:
        return text, linear, b.tensor_args(node)

    return build


_ELEMENTWISE_NONLINEAR = [
    aten.gelu.default,
    aten.relu.default,
    aten.erf.default,
    aten.exp.default,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.log.default,
    aten.abs.default,
    aten.sin.default,
    aten.cos.default,
    aten.reciprocal.default,
    aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor,
    aten.pow.Scalar,
    aten.le.Scalar,
    aten.lt.Scalar,
    aten.ge.Scalar,
    aten.gt.Scalar,
    aten.eq.Scalar,
    aten.ne.Scalar,
    aten.le.Tensor,
    aten.lt.Tensor,
    aten.ge.Tensor,
    aten.gt.Tensor,
    aten.eq.Tensor,
    aten.ne.Tensor,
    aten.logical_not.default,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.sign.default,
    aten.where.self,
    aten.maximum.default,
    aten.minimum.default,
    aten.silu.default,
    aten.log1p.default,
    aten.expm1.default,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
    aten.bitwise_not.default,
    aten.isnan.default,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.bitwise_xor.Tensor,
    aten.logical_xor.default,
    aten.atan2.default,
    aten.fmod.Scalar,
    aten.square.default,
    aten.remainder.Scalar,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.trunc.default,
]
_ELEMENTWISE_LINEAR_ONE = [
    aten.neg.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.alias.default,
    aten.detach.default,
]

REGISTRY: dict[Any, Builder] = {
    aten.mm.default: fixed("i k, k j -> i j", "one"),
    aten.bmm.default: fixed("b i k, b k j -> b i j", "one"),
    torch.ops.shardspec.matmul.default: b.batched_matmul,
    aten.add.Tensor: partial(b.binary_arith, all_tensor_linear="all"),
    aten.sub.Tensor: partial(b.binary_arith, all_tensor_linear="all"),
    aten.mul.Tensor: partial(b.binary_arith, all_tensor_linear="one"),
    aten.div.Tensor: partial(b.binary_arith, all_tensor_linear="first"),
    aten.gelu_backward.default: partial(b.elementwise, linear="first"),
    aten.threshold_backward.default: partial(b.elementwise, linear="first"),
    aten.sigmoid_backward.default: partial(b.elementwise, linear="first"),
    aten.tanh_backward.default: partial(b.elementwise, linear="first"),
    aten.silu_backward.default: partial(b.elementwise, linear="first"),
    aten.sum.dim_IntList: partial(b.reduction, kind="sum"),
    aten.sum.default: partial(b.reduction, kind="sum"),
    aten.amax.default: partial(b.reduction, kind="max"),
    aten.amin.default: partial(b.reduction, kind="max"),
    aten.permute.default: b.permute,
    aten.t.default: b.permute,
    aten.transpose.int: b.permute,
    aten.view.default: b.view,
    aten._unsafe_view.default: b.view,
    aten.view_copy.default: b.view,
    aten.reshape.default: b.view,
    aten.unsqueeze.default: b.view,
    aten.squeeze.dims: b.view,
    aten.squeeze.dim: b.view,
    aten.squeeze.default: b.view,
    aten.permute_copy.default: b.permute,
    aten.t_copy.default: b.permute,
    aten.transpose_copy.int: b.permute,
    aten.unsqueeze_copy.default: b.view,
    aten.squeeze_copy.dims: b.view,
    aten.squeeze_copy.dim: b.view,
    aten.squeeze_copy.default: b.view,
    aten._unsafe_view.default: b.view,
    aten.alias_copy.default: partial(b.elementwise, linear="one"),
    aten.mul.Scalar: partial(b.elementwise, linear="one"),
    aten.div.Scalar: partial(b.elementwise, linear="one"),
    aten.add.Scalar: partial(b.elementwise, linear="none"),
    aten.sub.Scalar: partial(b.elementwise, linear="none"),
    aten.rsub.Scalar: partial(b.elementwise, linear="none"),
    aten.expand.default: b.expand,
    aten.expand_copy.default: b.expand,
    aten.full.default: b.creation,
    aten.zeros.default: b.creation,
    aten.ones.default: b.creation,
    aten.empty.memory_format: b.creation,
    aten.scalar_tensor.default: b.creation,
    aten.full_like.default: b.creation,
    aten.zeros_like.default: b.creation,
    aten.ones_like.default: b.creation,
    aten.empty_like.default: b.creation,
    aten.arange.default: b.positional,
    aten.arange.start: b.positional,
    aten.arange.start_step: b.positional,
    aten._log_softmax.default: partial(b.softmax_like, operands=1, linear="none"),
    aten._softmax.default: partial(b.softmax_like, operands=1, linear="none"),
    aten._log_softmax_backward_data.default: partial(b.softmax_like, operands=2, linear="first"),
    aten._softmax_backward_data.default: partial(b.softmax_like, operands=2, linear="first"),
    aten.embedding.default: st.embedding,
    aten.index_put.default: st.index_put,
    aten.native_layer_norm.default: st.layer_norm,
    aten.split_with_sizes.default: st.split,
    aten.split.Tensor: st.split,
    aten.split_with_sizes_copy.default: st.split,
    aten.split_copy.Tensor: st.split,
    aten.cat.default: st.cat,
    aten.slice.Tensor: st.slice_,
    aten.slice_copy.Tensor: st.slice_,
    aten.select.int: st.select,
    aten.select_copy.int: st.select,
    aten.slice_scatter.default: st.slice_scatter,
    aten.index_select.default: st.index_select,
    aten.tril.default: st.triangle,
    aten.triu.default: st.triangle,
    aten.any.dim: st.reduce_any,
    aten.any.dims: st.reduce_any,
    aten.any.default: st.reduce_any,
    aten.all.dim: st.reduce_any,
    aten.all.default: st.reduce_any,
    aten.copy.default: partial(b.elementwise, linear="none"),
    aten.empty_permuted.default: b.creation,
    aten.new_zeros.default: b.creation,
    aten.new_ones.default: b.creation,
    aten.new_full.default: b.creation,
    aten.new_empty.default: b.creation,
    aten.masked_fill.Scalar: partial(b.elementwise, linear="none"),
    aten.gather.default: b.gather,
    aten.scatter.value: b.scatter,
    aten.scatter.src: b.scatter,
}
for _op in _ELEMENTWISE_NONLINEAR:
    REGISTRY[_op] = partial(b.elementwise, linear="none")
for _op in _ELEMENTWISE_LINEAR_ONE:
    REGISTRY[_op] = partial(b.elementwise, linear="one")


def rule_for(node: Node) -> tuple[Rule, list[Node]]:
    """The parsed rule of ``node`` and the tensor operands it covers."""
    build = REGISTRY.get(node.target)
    if build is None:
        raise MissingRule(str(node.target))
    text, linear, operands = build(node)
    return parse(text, linear), operands
