"""Stage 4: the per-rank program.

Walks the global graph in order and emits, for one rank, the same ops on local shards: each operand
is first brought to the sharding its op requires by the reshard plan (collectives and local slices,
memoized per value and target so a value is gathered or reduced once), shape arguments become this
rank's local shapes, and ``*_like`` creation ops become ``full`` of the local shape. Every inserted
collective records what it moves, why (which op needed which sharding of which value) and the user
line. Uneven shards give ranks different local shapes, so the program is built per rank; its
collective sequence is the same on every rank.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from collectives.ops import mesh_key
from compiler.decompose import is_addmm_add
from compiler.passes.graph import LazyProgram
from compiler.propagate import CONSTRAIN, Propagation, shape
from compiler.reshard import Step, plan
from compiler.rules.registry import _SPATIAL
from compiler.sharding import Sharding
from compiler.sources import source_of
from shardspec.layout import local_shape
from shardspec.mesh import Mesh

aten = torch.ops.aten
# ops whose argument at this index is the output's (global) shape: it becomes the local shape
_SIZE_ARG = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.view_copy.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    aten.expand_copy.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
    aten.full.default: 0,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.empty_permuted.default: 0,
}
# a resampling op's backward takes its input's size (batch and channels included): this rank's
_SIZE_ARG.update({getattr(aten, f"{name}_backward").default: 2 for name in _SPATIAL if "pad" not in name})
_VIEWS = {aten.view.default, aten._unsafe_view.default}
_LIKE = {
    aten.full_like.default: None,
    aten.zeros_like.default: 0,
    aten.ones_like.default: 1,
    aten.empty_like.default: 0,
}
_OPS = {
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter",
    "all_gather": "all_gather",
    "all_to_all": "all_to_all",
    "slice": "local_slice",
}


@dataclass(frozen=True)
class Inserted:
    """One collective the partitioner inserted."""

    kind: str
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes_per_rank: float
    reason: str
    source: str
    node: str
    value: str = ""  # the global graph's node resharded (explain names it in the user's words)
    consumer: str = ""  # the global node that needs it ("" for the step's result)


def value_name(n: Node, names: dict[Node, str]) -> str:
    if n in names:
        return names[n]
    where = source_of(n)
    return f"{n.name}" + (f" (from {where})" if where else "")


class _Partitioner:
    def __init__(
        self, module: GraphModule, prop: Propagation, mesh: Mesh, rank: int, input_names: list[str]
    ) -> None:
        self.src, self.prop, self.mesh, self.rank = module, prop, mesh, rank
        self.graph = Graph()
        self.env: dict[Node, Node] = {}
        self.memo: dict[tuple[Node, Sharding], Node] = {}
        self.inserted: list[Inserted] = []
        self.key = mesh_key(mesh)
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        self.names = dict(zip(placeholders, input_names, strict=True))

    def local(self, global_shape: tuple[int, ...], s: Sharding) -> tuple[int, ...]:
        return local_shape(global_shape, self.mesh, s.spec, self.rank) if global_shape else ()

    def reshard(self, value: Node, target: Sharding, consumer: str, source: str, by: str = "") -> Node:
        current = self.prop.value[value]
        if current == target:
            return self.env[value]
        if (value, target) in self.memo:
            return self.memo[(value, target)]
        x = self.env[value]
        gshape, dtype = shape(value), value.meta["val"].dtype
        for step in plan(gshape, dtype, current, target, self.mesh):
            x = self.emit(step, x)
            if step.kind != "slice":
                reason = f"{consumer} needs {value_name(value, self.names)} as {target}; it is {current}"
                self.inserted.append(
                    Inserted(
                        step.kind,
                        step.axes,
                        step.local_shape,
                        dtype,
                        step.bytes_per_rank,
                        reason,
                        source,
                        x.name,
                        value.name,
                        by,
                    )
                )
                x.meta["shardspec_reason"], x.meta["shardspec_source"] = reason, source
        self.memo[(value, target)] = x
        return x

    def emit(self, step: Step, x: Node) -> Node:
        kwargs: dict[str, Any] = {"axis": ",".join(step.axes), "mesh": self.key}
        if step.kind in ("reduce_scatter", "all_gather", "slice"):
            kwargs["dim"] = step.dim
        if step.kind == "all_gather":
            kwargs["size"] = step.size
        if step.kind == "all_to_all":
            kwargs.update(split_dim=step.dim, concat_dim=step.dim2, size=step.size)
        op = getattr(torch.ops.shardspec, _OPS[step.kind]).default
        return self.graph.call_function(op, (x,), kwargs)

    def run(self) -> tuple[GraphModule, list[Inserted]]:
        root = torch.nn.Module()
        for node in self.src.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.graph.placeholder(node.name)
            elif node.op == "get_attr":
                setattr(root, node.target, getattr(self.src, node.target))
                self.env[node] = self.graph.get_attr(node.target)
            elif node.op == "call_function":
                self.call(node)
            elif node.op == "output":
                outs = []
                for v, s in zip(node.args[0], self.prop.outputs, strict=True):
                    outs.append(self.reshard(v, s, "the step's result", source_of(v)))
                self.graph.output(tuple(outs))
        # code is generated when the program first runs or prints: the passes rewrite it first
        return LazyProgram(root, self.graph), self.inserted

    def call(self, node: Node) -> None:
        if node.target is operator.getitem:
            src, idx = node.args
            assert isinstance(src, Node)
            self.env[node] = self.graph.call_function(operator.getitem, (self.env[src], idx))
            return
        p = self.prop.plans[node]
        where = source_of(node)
        op_name = str(node.target).replace("aten.", "").replace(".default", "")
        mapped = {
            o: self.reshard(o, r, f"{op_name} (rule {p.rule.text})", where, node.name)
            for o, r in zip(p.operands, p.required, strict=True)
        }
        if node.target is CONSTRAIN:
            self.env[node] = mapped[node.args[0]]  # type: ignore[index]
            return
        single = isinstance(node.meta.get("val"), torch.Tensor)  # none: an op with no result
        lshape = self.local(shape(node), p.outputs[0]) if single else None
        if node.target in _LIKE:
            fill = node.args[1] if _LIKE[node.target] is None else _LIKE[node.target]
            val = node.meta["val"]
            self.env[node] = self.graph.call_function(
                aten.full.default, (list(lshape or ()), fill), {"dtype": val.dtype, "device": val.device}
            )
            return

        def local(a: Any) -> Any:
            if isinstance(a, Node):
                return mapped.get(a, self.env.get(a))
            if isinstance(a, (list, tuple)):
                return type(a)(local(x) for x in a)
            return a

        args = [local(a) for a in node.args]
        if node.target in _SIZE_ARG and lshape is not None:
            args[_SIZE_ARG[node.target]] = list(lshape)
        if node.target is aten.native_group_norm.default:  # N is passed explicitly: this rank's N
            args[3] = self.local(shape(p.operands[0]), p.required[0])[0]
        if node.target is aten.convolution_backward.default and args[3] is not None:
            # bias_sizes: this rank's output channels, grad_out's channel dim (after a batch dim)
            grad_out = self.local(shape(p.operands[0]), p.required[0])
            batched = len(shape(p.operands[1])) == len(shape(p.operands[2]))
            args[3] = [grad_out[1 if batched else 0]]
        # keyword tensors as resharded for this op too (the replicate fallback counts them as operands)
        kwargs = {k: local(v) for k, v in node.kwargs.items()}
        assert callable(node.target)
        fused = self.addmm(node, args)
        # a view of the global value may not be one of a local block (a slice has other strides);
        # the program mutates nothing, so reshape (a view where it can be) means the same
        target = aten.reshape.default if node.target in _VIEWS else node.target
        self.env[node] = fused or self.graph.call_function(target, tuple(args), kwargs)
        self.env[node].meta["shardspec_origin"] = node.name

    def addmm(self, node: Node, args: list[Any]) -> Node | None:
        """``add(mm(a, b), bias)`` on this rank -> ``addmm(bias, a, b)``: one kernel, the bias added
        inside the matrix product, as a linear layer runs eagerly. Only where the product reaches the
        add as it is (no collective between, so a split contraction was reduced first or the add is
        part of the pending sum) and nothing else reads it; trace.py writes addmm as mm + add so
        propagation can keep a split contraction's sum pending without the bias. Only adds trace.py
        marked as an addmm's (``is_addmm_add``): a hand-written ``x @ w + b`` stays mm then add,
        rounded twice as in eager."""
        if node.target is not aten.add.Tensor or node.kwargs or len(args) != 2 or not is_addmm_add(node):
            return None
        product, bias = node.args[0], node.args[1]
        local_product = args[0]
        view = None  # a linear layer on (..., in): the product viewed back to (..., out) first
        if (
            isinstance(product, Node)
            and product.target in _VIEWS
            and len(product.users) == 1
            and isinstance(product.args[0], Node)
            and isinstance(local_product, Node)
            and local_product.target is aten.reshape.default
            and local_product is self.env.get(product)
            and not local_product.users
        ):
            view, product, local_product = local_product, product.args[0], local_product.args[0]
        if not (
            isinstance(product, Node)
            and isinstance(bias, Node)
            and isinstance(local_product, Node)
            and product.target is aten.mm.default
            and len(product.users) == 1
            and local_product is self.env.get(product)
            and local_product.target is aten.mm.default
            and len(local_product.users) == (1 if view is not None else 0)
        ):
            return None
        out, b = product.meta["val"], bias.meta["val"]
        if (
            b.dim() != 1
            or b.shape[0] != out.shape[1]
            or b.dtype != out.dtype
            or node.meta["val"].shape[-1] != out.shape[1]
            or node.meta["val"].numel() != out.numel()
        ):
            return None
        a, w = local_product.args
        fused = self.graph.call_function(aten.addmm.default, (args[1], a, w))
        if view is not None:
            fused = self.graph.call_function(aten.reshape.default, (fused, *view.args[1:]))
            self.graph.erase_node(view)
        self.graph.erase_node(local_product)
        return fused


def partition(
    module: GraphModule, prop: Propagation, mesh: Mesh, rank: int, input_names: list[str]
) -> tuple[GraphModule, list[Inserted]]:
    """The program rank ``rank`` runs, and the collectives inserted into it."""
    return _Partitioner(module, prop, mesh, rank, input_names).run()
