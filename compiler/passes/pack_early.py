"""Pack early: each gradient is copied into its bucket's flat buffer as soon as it is computed.

Bucketing packs a gradient bucket with one ``cat`` placed after its last member is computed, so at
that moment every member gradient and the flat buffer they are copied into are live together: for
DP's one 25 MiB bucket that is two full copies of the gradients at the end of backward, the step's
peak. DDP avoids the second copy by accumulating each gradient into its persistent bucket as
autograd produces it. Here the flat buffer is allocated where the bucket's first member is computed
and each member is copied into its slice of it right after it is computed, so a member's own buffer
dies at once (when nothing else reads it) and the bucket holds the gradients once. The buffer lives
no longer than before in total: the members it replaces were live from their computation anyway.

On a real mesh's eager runtime an all-reduce bucket nothing returns is held between calls
(``held.py``): resident before the step starts, it costs nothing until it is written, so there
(``held=True``) every member is copied in as soon as it is computed, the start that lets each
gradient's own buffer die at once; the position choice below prices a buffer allocated per call.

Runs after ``overlap``, on the scheduled program (no later pass moves nodes by their data
dependencies, which would not see the copies the launch depends on). Applies to ``cat``s feeding a
gradient launch (``all_reduce_inplace``, or ``reduce_scatter`` of the flattened rows) whose pieces
are views of computed values; parameter gathers pack program inputs, live throughout anyway.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from compiler.passes import liveness
from compiler.passes.bucketing import BUCKET_CAT
from compiler.passes.colocate import HELD_BUCKET
from compiler.passes.graph import aliases_input, copy_module, make, mutates, val
from compiler.passes.views import small_views

aten = torch.ops.aten
ops = torch.ops.shardspec
_GRADIENT_LAUNCHES = {ops.all_reduce_inplace.default, ops.reduce_scatter.default}


def pack_early(gm: GraphModule, held: bool = False) -> GraphModule:
    """The program with gradient buckets filled as their members are computed (see the module doc;
    ``held``: all-reduce buckets will be held between calls)."""
    gm = copy_module(gm)
    pack_early_(gm, held)
    gm.recompile()
    return gm


def pack_early_(gm: GraphModule, held: bool = False) -> None:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    copied = small_views(list(out.all_input_nodes))  # returned as copies (``dense_results_``)
    escaping = liveness.result_roots(gm, copied) if held else set()
    for cat in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.cat.default]:
        launch = _feeds_gradient_launch(cat)
        if launch is not None:
            at_once = held and launch.target is ops.all_reduce_inplace.default and cat not in escaping
            _fill_as_computed(gm, cat, at_once)
    gm.graph.lint()


def _feeds_gradient_launch(cat: Node) -> Node | None:
    """The gradient launch a bucket's ``cat`` feeds, if it does."""
    if not cat.meta.get(BUCKET_CAT):  # a cat of the user's own, reduced as it is
        return None
    users = list(cat.users)
    while len(users) == 1 and users[0].target is aten.reshape.default:  # reduce_scatter's flat view
        users = list(users[0].users)
    return users[0] if len(users) == 1 and users[0].target in _GRADIENT_LAUNCHES else None


def _chain(piece: Node) -> list[Node] | None:
    """The single-use views from a computed value to ``piece`` (value first), else None."""
    chain = [piece]
    while True:
        x = chain[-1]
        if x.op != "call_function" or len(x.users) != 1:
            return None
        inputs = x.all_input_nodes
        if len(inputs) != 1 or not aliases_input(x) or mutates(x):
            break
        chain.append(inputs[0])
    src = chain[-1]
    if src.op != "call_function" or aliases_input(src):
        return None  # a program input (or a view of one): live from the start, nothing to gain
    return chain[::-1]


def pos_of(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _best_start(gm: GraphModule, cat: Node, chains: list[list[Node]]) -> int:
    """Which member's computation (in program order) to allocate the flat buffer at: the one giving
    the lowest peak. Earlier members wait there to be copied (live as before), later ones are
    copied as they are computed; from there on the buffer is held instead of the members."""
    pos = pos_of(gm.graph)
    live = [0] * len(pos)
    for n, b in liveness.curve(gm)[1:]:
        assert n is not None
        live[pos[n]] = b
    made = sorted((pos[c[0]], liveness.nbytes(c[-1])) for c in chains)
    return best_start(live, made, pos[cat], liveness.nbytes(cat))


def best_start(live: list[int], made: list[tuple[int, int]], end: int, total: int) -> int:
    """The index into ``made`` (members' (position, bytes), by position) whose position to allocate
    the ``total``-byte buffer at, for the lowest peak of ``live`` (bytes after each op) before the
    ``cat`` at ``end``.

    After op ``t`` past the start the program holds ``live[t]`` less the members computed by then
    (copied into the buffer) plus the buffer; that excess does not depend on the start, so one
    suffix maximum of it prices every start: linear in the program, not members x ops."""
    net, held, i = [0] * end, 0, 0
    for t in range(end):
        while i < len(made) and made[i][0] <= t:
            held += made[i][1]
            i += 1
        net[t] = live[t] - held
    suffix = [0] * (end + 1)  # suffix[t]: the largest net[t:end]
    for t in range(end - 1, -1, -1):
        suffix[t] = net[t] if t == end - 1 else max(suffix[t + 1], net[t])
    prefix = [0] * (end + 1)  # prefix[t]: the largest live[:t] (0 for none)
    for t in range(end):
        prefix[t + 1] = max(prefix[t], live[t])
    best, best_peak = 0, None
    for k, (start, _) in enumerate(made):
        after = live[start] + total  # the buffer made while the members so far are still held
        if start + 1 < end:
            after = max(after, suffix[start + 1] + total)
        peak = max(prefix[start], after)
        if best_peak is None or peak < best_peak:
            best, best_peak = k, peak
    return best


def _fill_as_computed(gm: GraphModule, cat: Node, at_once: bool) -> None:
    graph = gm.graph
    pieces = cat.args[0]
    dim = int(cat.args[1]) if len(cat.args) > 1 else 0  # type: ignore[arg-type]
    out = val(cat)
    if not isinstance(pieces, (list, tuple)) or not isinstance(out, torch.Tensor):
        return
    found = [_chain(p) if isinstance(p, Node) else None for p in pieces]
    chains = [c for c in found if c is not None]
    if len(chains) != len(pieces) or len({id(p) for p in pieces}) != len(pieces):
        return
    pos = pos_of(graph)
    order = sorted(range(len(chains)), key=lambda j: pos[chains[j][0]])
    k = 0 if at_once else _best_start(gm, cat, [chains[j] for j in order])
    first = chains[order[k]][0]
    with graph.inserting_after(first):
        buf = make(graph, aten.new_empty.default, (first, list(out.shape)))
    buf.meta["shardspec_flat_bucket"] = True
    if at_once:
        buf.meta[HELD_BUCKET] = True  # for ``colocate``
    anchor = buf  # members computed by then are copied right after the buffer, in order
    offsets = [0]
    for p in pieces:
        offsets.append(offsets[-1] + int(val(p).shape[dim]))
    written: list[Node] = []  # members now computed straight into the buffer
    for rank, j in enumerate(order):
        chain = chains[j]
        src = chain[0]
        if rank > k and out.dim() == 1 and _flat_view_of_product(chain, out.dtype):
            with graph.inserting_before(src):
                part = make(graph, aten.slice.Tensor, (buf, dim, offsets[j], offsets[j + 1]))
                dest = make(graph, aten.view.default, (part, list(val(src).shape)))
                make(graph, aten.mm.out, tuple(src.args), {"out": dest}, value=val(dest))
            written.append(src)
            continue
        after = anchor if rank <= k else src
        with graph.inserting_before(after.next):  # in order, right after ``after``
            x = src
            for v in chain[1:]:  # the piece's views, now where it is copied (the same values)
                x = make(graph, v.target, (x, *v.args[1:]), dict(v.kwargs), value=val(v))
            part = make(graph, aten.slice.Tensor, (buf, dim, offsets[j], offsets[j + 1]))
            copied = make(graph, aten.copy_.default, (part, x))
        if rank <= k:
            anchor = copied
    cat.replace_all_uses_with(buf)
    graph.erase_node(cat)
    for chain in chains:
        for v in reversed(chain[1:]):
            if not v.users:
                graph.erase_node(v)
    for src in written:
        graph.erase_node(src)


def _flat_view_of_product(chain: list[Node], dtype: torch.dtype) -> bool:
    """Whether a member is a weight gradient's ``mm`` seen through views that keep its memory order
    (``t(t(mm))``, ``reshape(-1)``): then the product can be written into its slice of the bucket
    (``mm.out``) instead of into a buffer of its own copied there, as DDP's gradient-as-bucket-view
    does. A view that reorders (a single ``t``) copies at the flattening, which the fake storages
    show; such a member is copied as before."""
    src, piece = val(chain[0]), val(chain[-1])
    return (
        chain[0].target is aten.mm.default
        and not chain[0].kwargs
        and isinstance(src, torch.Tensor)
        and isinstance(piece, torch.Tensor)
        and src.dtype == dtype
        and src.is_contiguous()
        and piece.is_contiguous()
        and piece.storage_offset() == 0
        and piece.numel() == src.numel()
        and piece.untyped_storage()._cdata == src.untyped_storage()._cdata
    )
