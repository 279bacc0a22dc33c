"""Views instead of copies: functionalization turns every view into its ``*_copy`` op, so a traced step
copies each transpose, reshape and slice it takes. In the per-rank program nothing is mutated after it
is made (collectives allocate their outputs; the one in-place collective only ever reduces a buffer no
one else sees), so each of these can be the view it was written as.

``view_copy`` becomes ``reshape`` (a view where the strides allow, a copy where the input is itself a
non-contiguous view now), and the program's existing ``view``/``_unsafe_view`` nodes become ``reshape``
for the same reason. Results stay copies where they are returned (a step's results must not alias its
arguments or each other), and the rare storage-level ops (``as_strided``, dtype views) get a dense input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from compiler.passes.graph import aliases_input, copy_module, mutates, outputs

aten = torch.ops.aten
# functionalization's copy variants whose view counterpart takes the same arguments
_COPIES = (
    "permute_copy",
    "transpose_copy",
    "t_copy",
    "expand_copy",
    "slice_copy",
    "select_copy",
    "unsqueeze_copy",
    "squeeze_copy",
    "alias_copy",
    "diagonal_copy",
    "narrow_copy",
    "unbind_copy",
    "split_copy",
    "split_with_sizes_copy",
    "unfold_copy",
    "detach_copy",
    "view_as_real_copy",
    "view_as_complex_copy",
)
_RESHAPES = {aten.view_copy.default, aten.view.default, aten._unsafe_view.default}
# ops that read their input's storage layout, not its values: they need the dense layout they had
_STORAGE = {aten.as_strided.default, aten.as_strided_copy.default, aten.view_copy.dtype, aten.view.dtype}


def _view_of(target: object) -> object | None:
    if target in _RESHAPES:
        return aten.reshape.default
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.name.startswith("aten::"):
        return None
    name = schema.name[len("aten::") :]
    if name not in _COPIES:
        return None
    base = getattr(aten, name[: -len("_copy")], None)
    overload = getattr(target, "_overloadname", "default")
    return getattr(base, overload, None) if base is not None else None


def views(gm: GraphModule) -> GraphModule:
    """``*_copy`` ops -> their views, wherever no mutation and no returned result can observe it."""
    gm = copy_module(gm)
    views_(gm)
    gm.recompile()
    return gm


def views_(gm: GraphModule) -> None:
    """``views`` in place (the pipeline copies the program once, not once per pass)."""
    if any(mutates(n) for n in gm.graph.nodes):
        return  # views are only safe in a program that mutates nothing
    results = outputs(gm)
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in _STORAGE:
            src = n.args[0]
            assert isinstance(src, Node)
            with gm.graph.inserting_before(n):
                dense = gm.graph.call_function(
                    aten.clone.default, (src,), {"memory_format": torch.contiguous_format}
                )
            dense.meta = dict(src.meta)
            n.replace_input_with(src, dense)
            continue
        view = _view_of(n.target)
        if view is None or n in results or any(u in results for u in n.users):
            continue  # results of multi-output views are getitem users
        n.target = view


def dense_results(gm: GraphModule) -> GraphModule:
    """Results computed from views may be strided: return them contiguous (a no-op where they are)."""
    gm = copy_module(gm)
    dense_results_(gm)
    gm.recompile()
    return gm


def dense_results_(gm: GraphModule) -> None:
    """Each computed result contiguous; a result that is a small view of a larger buffer the program
    made (the loss in DP's gradient bucket) a copy of its own, so keeping it (a list of losses)
    does not keep the whole buffer alive."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    done: dict[Node, Node] = {}
    copied = small_views(list(out.all_input_nodes))

    def dense(a: object) -> object:
        if not isinstance(a, Node) or a.op != "call_function":
            return a
        if a not in done:
            with gm.graph.inserting_before(out):
                if a in copied:
                    fmt: dict[str, Any] = {"memory_format": torch.contiguous_format}
                    done[a] = gm.graph.call_function(aten.clone.default, (a,), fmt)
                else:
                    done[a] = gm.graph.call_function(aten.contiguous.default, (a,))
            done[a].meta = dict(a.meta)
        return done[a]

    out.args = tuple(
        tuple(dense(a) for a in arg) if isinstance(arg, (tuple, list)) else dense(arg) for arg in out.args
    )


def small_views(results: list[Node]) -> set[Node]:
    """The results that view a buffer the program computed while all the results viewing it cover
    less than half of it: returned as views, they would hold the rest of it too."""
    by_root: dict[Node, list[Node]] = {}
    for r in dict.fromkeys(results):
        root = r
        while root.op == "call_function" and root.all_input_nodes and aliases_input(root):
            root = root.all_input_nodes[0]
        if root is not r and root.op == "call_function":
            by_root.setdefault(root, []).append(r)
    small: set[Node] = set()
    for root, views in by_root.items():
        whole, parts = _numel(root), [_numel(v) for v in views]
        if whole is not None and None not in parts and 2 * sum(parts) < whole:  # type: ignore[arg-type]
            small.update(views)
    return small


def _numel(n: Node) -> int | None:
    v = n.meta.get("val")
    return v.numel() if isinstance(v, torch.Tensor) else None


# ATen CPU kernels that read their tensor operands as dense memory: with a strided view they raise
# (group norm's input) or silently compute garbage (group norm's weight, both norms' backward).
DENSE_KERNELS = frozenset(
    {
        aten.native_group_norm.default,
        aten.native_group_norm_backward.default,
        aten.native_layer_norm.default,
        aten.native_layer_norm_backward.default,
        aten.native_batch_norm.default,
        aten.native_batch_norm_backward.default,
        aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit_functional.default,
        aten._native_batch_norm_legit_no_training.default,
    }
)


# fused attention kernels read each row of q, k, v (and the output and its gradient) as dense memory:
# a strided last dim (a view this pass made of a copy) is read wrongly, other strides are fine
# (heads-major q from a transpose); the positions of those operands per kernel
DENSE_ROWS: dict[object, tuple[int, ...]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 1, 2),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1, 2, 3, 4),
    aten._scaled_dot_product_efficient_attention.default: (0, 1, 2),
    aten._scaled_dot_product_efficient_attention_backward.default: (0, 1, 2, 3, 5),
}


def _dense_rows(a: Node) -> bool:
    v = a.meta.get("val")
    return isinstance(v, torch.Tensor) and (v.dim() == 0 or v.stride(-1) == 1 or v.shape[-1] <= 1)


def dense_kernel_inputs_(gm: GraphModule) -> None:
    """Give the kernels of ``DENSE_KERNELS`` contiguous operands, and those of ``DENSE_ROWS`` dense
    rows (each a no-op at run time where they are)."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or (n.target not in DENSE_KERNELS and n.target not in DENSE_ROWS):
            continue
        made: dict[Node, Node] = {}
        rows = DENSE_ROWS.get(n.target)

        def dense(a: object, n: Node = n, made: dict[Node, Node] = made) -> object:
            if not isinstance(a, Node):
                return a
            if a not in made:
                with gm.graph.inserting_before(n):
                    made[a] = gm.graph.call_function(aten.contiguous.default, (a,))
                made[a].meta = dict(a.meta)
            return made[a]

        if rows is not None:
            n.args = tuple(
                a if i not in rows or not isinstance(a, Node) or _dense_rows(a) else dense(a)
                for i, a in enumerate(n.args)
            )
            continue
        n.args = tuple([dense(x) for x in a] if isinstance(a, (list, tuple)) else dense(a) for a in n.args)
