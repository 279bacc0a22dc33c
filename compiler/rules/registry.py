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

import compiler.pipeline.boundary  # defines torch.ops.shardspec.pipeline_boundary
import compiler.rewrites  # noqa: F401  (defines torch.ops.shardspec.matmul)
import shardspec.optim  # noqa: F401  (defines torch.ops.shardspec.adamw)
from compiler.rules import builders as b
from compiler.rules import fused
from compiler.rules import indexing as ix
from compiler.rules import reductions as red
from compiler.rules import spatial as sp
from compiler.rules import structural as st
from compiler.rules import transforms as tf
from compiler.rules.elementwise_ops import ELEMENTWISE_LINEAR_ONE, ELEMENTWISE_NONLINEAR
from compiler.rules.notation import Rule, parse

aten = torch.ops.aten
Builder = Callable[[Node], b.Built]


class MissingRule(KeyError):
    """No sharding rule for an op."""


def fixed(text: str, linear: str) -> Builder:
    def build(node: Node) -> b.Built:
        return text, linear, b.tensor_args(node)

    return build


REGISTRY: dict[Any, Builder] = {
    aten.mm.default: fixed("i k, k j -> i j", "one"),
    aten.bmm.default: fixed("b i k, b k j -> b i j", "one"),
    torch.ops.shardspec.matmul.default: b.batched_matmul,
    torch.ops.shardspec.check_classes.default: partial(b.elementwise, linear="none"),
    torch.ops.shardspec.pipeline_boundary.default: partial(b.elementwise, linear="all"),
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
    aten.index.Tensor: ix.index,
    aten._unsafe_index.Tensor: ix.index,
    aten.index_put.default: ix.index_put,
    aten._unsafe_index_put.default: ix.index_put,
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
    aten.index_select.default: ix.index_select,
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
    aten.scatter_add.default: b.scatter,
    aten.scatter_reduce.two: b.scatter,
    aten.bucketize.Tensor: partial(st.lookup, table_first=False),
    aten.searchsorted.Tensor: partial(st.lookup, table_first=True),
    aten.addmv.default: st.bias_contraction,
    aten.addbmm.default: st.bias_contraction,
    aten.histc.default: red.everything,
    aten.frexp.Tensor: st.two_outputs,
    aten.max_pool2d_with_indices_backward.default: st.pool_backward,
    aten.lift_fresh_copy.default: partial(b.elementwise, linear="one"),
    aten._to_copy.default: b.cast,
    aten.prod.default: red.everything,
    aten.max.default: red.everything,
    aten.min.default: red.everything,
    aten.median.default: red.everything,
    aten.nanmedian.default: red.everything,
    aten.prod.dim_int: partial(red.along, keep_arg=2),
    aten.argmax.default: partial(red.along, keep_arg=2),
    aten.argmin.default: partial(red.along, keep_arg=2),
    aten.max.dim: partial(red.along, keep_arg=2),
    aten.min.dim: partial(red.along, keep_arg=2),
    aten.median.dim: partial(red.along, keep_arg=2),
    aten.nanmedian.dim: partial(red.along, keep_arg=2),
    aten.mode.default: partial(red.along, default=-1, keep_arg=2),
    aten.kthvalue.default: partial(red.along, dim_arg=2, default=-1, keep_arg=3),
    aten.var.correction: partial(red.along, keep_arg=None),
    aten.var_mean.correction: partial(red.along, keep_arg=None),
    aten.linalg_vector_norm.default: partial(red.along, dim_arg=2, keep_arg=3),
    aten.cumsum.default: partial(red.along, drops=False),
    aten.cumprod.default: partial(red.along, drops=False),
    aten.cummax.default: partial(red.along, drops=False),
    aten.cummin.default: partial(red.along, drops=False),
    aten.logcumsumexp.default: partial(red.along, drops=False),
    aten.sort.default: partial(red.along, default=-1, drops=False),
    aten.sort.stable: partial(red.along, default=-1, drops=False),  # dim keyword-only: from kwargs
    aten.topk.default: red.topk,
    aten.flip.default: red.flip,
    aten.repeat.default: red.repeat,
    aten.constant_pad_nd.default: red.pad,
    aten.unbind_copy.int: red.unbind,
    aten.unbind.int: red.unbind,
    aten.diagonal.default: red.diagonal,
    aten.diagonal_copy.default: red.diagonal,
    aten.narrow_copy.default: st.slice_,
    aten.convolution.default: sp.convolution,
    aten.convolution_backward.default: sp.convolution_backward,
    aten.avg_pool2d_backward.default: sp.avg_pool_backward,
    aten.avg_pool3d_backward.default: sp.avg_pool_backward,
    aten.diagonal_scatter.default: red.diagonal_scatter,
    aten.avg_pool2d.default: partial(sp.pooling, spatial=2),
    aten.avg_pool3d.default: partial(sp.pooling, spatial=3),
    aten.max_pool2d_with_indices.default: partial(sp.pooling, spatial=2),
    aten.max_pool3d_with_indices.default: partial(sp.pooling, spatial=3),
    aten._adaptive_avg_pool2d.default: partial(sp.pooling, spatial=2),
    aten._adaptive_avg_pool3d.default: partial(sp.pooling, spatial=3),
    aten.adaptive_max_pool2d.default: partial(sp.pooling, spatial=2),
    aten.adaptive_max_pool3d.default: partial(sp.pooling, spatial=3),
    aten.native_batch_norm.default: sp.batch_norm,
    aten.native_group_norm.default: sp.group_norm,
    aten.scatter.value: b.scatter,
    aten.scatter.src: b.scatter,
    aten.scatter.reduce: b.scatter,
    aten.scatter.value_reduce: b.scatter,
}
for _op in ELEMENTWISE_NONLINEAR:
    REGISTRY[_op] = partial(b.elementwise, linear="none")
_BATCHED_MATRIX = [
    aten.cholesky.default,
    aten.cholesky_inverse.default,
    aten.cholesky_solve.default,
    aten.linalg_cholesky_ex.default,
    aten.linalg_inv_ex.default,
    aten._linalg_det.default,
    aten._linalg_slogdet.default,
    aten.linalg_qr.default,
    aten._linalg_svd.default,
    aten._linalg_eigh.default,
    aten.linalg_eig.default,
    aten.linalg_lu.default,
    aten.linalg_lu_factor_ex.default,
    aten.linalg_lu_solve.default,
    aten._linalg_solve_ex.default,
    aten.linalg_solve_triangular.default,
    aten.triangular_solve.default,
    aten.linalg_matrix_exp.default,
    aten.linalg_householder_product.default,
    aten.lu_unpack.default,
    aten.linalg_ldl_factor_ex.default,
    aten.linalg_ldl_solve.default,
    aten.geqrf.default,
    aten.ormqr.default,
]
for _op in _BATCHED_MATRIX:
    REGISTRY[_op] = red.batched_matrix
for _op in ELEMENTWISE_LINEAR_ONE:
    REGISTRY[_op] = partial(b.elementwise, linear="one")

# resampling and padding ops by name, with their spatial dims; each has a ``<name>_backward``
_SPATIAL = {
    "upsample_nearest1d": 1,
    "upsample_nearest2d": 2,
    "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1,
    "_upsample_nearest_exact2d": 2,
    "_upsample_nearest_exact3d": 3,
    "upsample_linear1d": 1,
    "upsample_bilinear2d": 2,
    "_upsample_bilinear2d_aa": 2,
    "upsample_bicubic2d": 2,
    "_upsample_bicubic2d_aa": 2,
    "upsample_trilinear3d": 3,
    "reflection_pad1d": 1,
    "reflection_pad2d": 2,
    "reflection_pad3d": 3,
    "replication_pad1d": 1,
    "replication_pad2d": 2,
    "replication_pad3d": 3,
}
_RESAMPLE = [getattr(aten, name).default for name in _SPATIAL]
_RESAMPLE_BACKWARD = [getattr(aten, name + "_backward").default for name in _SPATIAL]
for _name, _n in _SPATIAL.items():
    REGISTRY[getattr(aten, _name).default] = partial(sp.pooling, spatial=_n)
    _grad = sp.pad_backward if "pad" in _name else sp.upsample_backward
    REGISTRY[getattr(aten, _name + "_backward").default] = partial(_grad, spatial=_n)
# ops whose every dim stays whole: flat positions (put, histogram), data-ordered writes
# (masked_scatter), mixed contractions (bilinear's _trilinear), bags
for _op in (
    aten.dist.default,
    aten.put.default,
    aten.masked_scatter.default,
    aten._trilinear.default,
    aten.index_reduce.default,
    aten.histogram.bin_ct,
    aten.histogram.bins_tensor,
    aten._pdist_forward.default,
    aten._pdist_backward.default,
    aten._embedding_bag_forward_only.default,
    aten._embedding_bag.default,
    aten.linalg_pinv.atol_rtol_tensor,
    aten._embedding_bag_per_sample_weights_backward.default,
    aten._embedding_bag_dense_backward.default,
    aten.masked_scatter_backward.default,
    aten.multi_margin_loss_backward.default,
    aten.hash_tensor.default,
    aten.nonzero_static.default,
    aten._histogramdd_bin_edges.default,
    aten._histogramdd_from_bin_tensors.default,
    aten._histogramdd_from_bin_cts.default,
    aten.multilabel_margin_loss_backward.default,
):
    REGISTRY[_op] = ix.whole
REGISTRY.update(
    {
        aten.unfold.default: tf.unfold,
        aten.unfold_copy.default: tf.unfold,
        aten.unfold_backward.default: tf.unfold_backward,
        aten._cdist_forward.default: tf.cdist,
        aten._cdist_backward.default: tf.cdist_backward,
        aten._fft_r2c.default: tf.fft,
        aten._fft_c2c.default: tf.fft,
        aten._fft_c2r.default: tf.fft,
        aten.view_as_real.default: tf.view_as_real,
        aten.view_as_complex.default: tf.view_as_complex,
        aten.view_as_real_copy.default: tf.view_as_real,
        aten.view_as_complex_copy.default: tf.view_as_complex,
        aten._conj_copy.default: partial(b.elementwise, linear="none"),
        aten._conj_physical.default: partial(b.elementwise, linear="none"),
        aten.conj_physical.default: partial(b.elementwise, linear="none"),
        aten.max_pool3d_with_indices_backward.default: partial(sp.pool_grad, spatial=3, idx_arg=7),
        aten.adaptive_max_pool2d_backward.default: partial(sp.pool_grad, spatial=2, idx_arg=2),
        aten.adaptive_max_pool3d_backward.default: partial(sp.pool_grad, spatial=3, idx_arg=2),
        aten.softshrink_backward.default: partial(b.elementwise, linear="first"),
        aten.hardshrink_backward.default: partial(b.elementwise, linear="first"),
        aten.new_empty_strided.default: b.creation,
        aten._efficientzerotensor.default: b.creation,
        aten._adaptive_avg_pool2d_backward.default: partial(sp.pad_backward, spatial=2),
        aten._adaptive_avg_pool3d_backward.default: partial(sp.pad_backward, spatial=3),
        aten.grid_sampler_2d.default: tf.grid_sampler,
        aten.grid_sampler_3d.default: tf.grid_sampler,
        aten.grid_sampler_2d_backward.default: tf.grid_sampler_backward,
        aten.grid_sampler_3d_backward.default: tf.grid_sampler_backward,
        aten.complex.default: partial(b.elementwise, linear="none"),
        aten.polar.default: partial(b.elementwise, linear="none"),
        aten.native_layer_norm_backward.default: fused.layer_norm_backward,
        aten._scaled_dot_product_flash_attention_for_cpu.default: fused.flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: fused.flash_attention_backward,
        aten._scaled_dot_product_efficient_attention.default: fused.efficient_attention,
        aten._scaled_dot_product_efficient_attention_backward.default: fused.efficient_attention_backward,
        torch.ops.shardspec.adamw.default: fused.adamw,
    }
)


# kernels that reject a zero-size block on any dim (an uneven split can leave a rank with none)
NO_EMPTY_BLOCKS = {
    aten.convolution.default,
    aten.convolution_backward.default,
    aten.avg_pool2d_backward.default,
    aten.avg_pool3d_backward.default,
    aten.native_batch_norm.default,
    aten.native_group_norm.default,
    aten.avg_pool2d.default,
    aten.avg_pool3d.default,
    aten.max_pool2d_with_indices.default,
    aten.max_pool3d_with_indices.default,
    aten._adaptive_avg_pool2d.default,
    aten._adaptive_avg_pool3d.default,
    aten.adaptive_max_pool2d.default,
    aten.adaptive_max_pool3d.default,
    *_RESAMPLE,
    *_RESAMPLE_BACKWARD,
    aten.grid_sampler_2d.default,
    aten.grid_sampler_3d.default,
    aten._adaptive_avg_pool2d_backward.default,
    aten._adaptive_avg_pool3d_backward.default,
    aten.max_pool3d_with_indices_backward.default,
    aten.adaptive_max_pool2d_backward.default,
    aten.adaptive_max_pool3d_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
}


def rule_for(node: Node) -> tuple[Rule, list[Node]]:
    """The parsed rule of ``node`` and the tensor operands it covers."""
    build = REGISTRY.get(node.target)
    if build is None:
        raise MissingRule(str(node.target))
    keyword_tensors: list[Node] = []
    torch.fx.node.map_arg(node.kwargs, keyword_tensors.append)
    try:
        text, linear, operands = build(node)
    except (KeyError, IndexError, TypeError, ValueError, AssertionError, ArithmeticError) as exc:
        raise MissingRule(f"{node.target} ({exc})") from None
    if any(t not in operands for t in keyword_tensors):
        # a tensor passed by keyword that the rule does not place would reach the kernel as
        # whatever block its producer left (segment_reduce's lengths=, weight=)
        raise MissingRule(f"{node.target} (a tensor passed by keyword)")
    rule = parse(text, b.exact_linearity(node, linear, operands))
    _check_fits(node, rule, operands)
    return rule, operands


def _check_fits(node: Node, rule: Rule, operands: list[Node]) -> None:
    """A rule must match the node's operand and output ranks; one that does not is not a rule for
    this call (and using it could place data wrongly), so the op counts as having none."""
    vals = node.meta["val"]
    outs = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    ok = len(rule.operands) == len(operands) and len(rule.outputs) == len(outs)
    ok = ok and all(len(t) == len(b.shape_of(o)) for t, o in zip(rule.operands, operands, strict=False))
    ok = ok and all(v is None or len(t) == v.dim() for t, v in zip(rule.outputs, outs, strict=False))
    if not ok:
        raise MissingRule(f"{node.target} (its rule {rule.text!r} does not fit these shapes)")
