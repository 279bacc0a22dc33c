"""Rule builders for fused kernels kept through tracing: layer norm's backward and the attention
kernels (CPU flash, CUDA memory-efficient) and their backward.

A fused kernel is linear in fewer operands than the chain it replaces, so each rule names exactly the
operands it is linear in, and a factor a result both keeps and sums over stays whole (a rule has one
set of reductions).
"""

from __future__ import annotations

from torch.fx import Node

from compiler.rules.builders import Built, arg, shape_of
from compiler.rules.notation import letters, line


def layer_norm_backward(node: Node) -> Built:
    """native_layer_norm_backward(grad, x, shape, mean, rstd, weight, bias, [True, False, False]):
    the input's gradient only (trace.py asks the kernel for nothing else and sums the weight and
    bias gradients itself). Leading dims pass through, normalized dims stay whole; linear in grad
    (grad_x = rstd·(w·g − mean(w·g) − x̂·mean(w·g·x̂)) with x̂ and rstd fixed)."""
    g, x, normalized, mean, rstd = (arg(node, k) for k in range(5))
    weight, bias, mask = arg(node, 5), arg(node, 6), list(arg(node, 7))
    if mask != [True, False, False]:
        raise KeyError("layer norm's weight/bias gradients are traced as sums, not by the kernel")
    k = len(normalized)
    lead = letters(len(shape_of(x)) - k)
    normed = [f"n{j}!" for j in range(k)]
    stats = [*lead, *(["1"] * k)]
    operands, tokens = [g, x, mean, rstd], [[*lead, *normed], [*lead, *normed], stats, stats]
    for t in (weight, bias):
        if isinstance(t, Node):
            operands.append(t)
            tokens.append(normed)
    return line(tokens, [[*lead, *normed], [], []]), "first", operands


def flash_attention(node: Node) -> Built:
    """_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal) -> (out, lse):
    batch and heads pass through (a heads split survives); the head dim is contracted under a
    softmax and the key sequence is the softmax's dim, so both stay whole. The query sequence is
    free without a causal mask (each query row is independent), whole with one (the mask depends on
    the query's global position). Not linear: lse does not depend on v, and out is softmax(q·kᵀ)."""
    q, k, v = arg(node, 0), arg(node, 1), arg(node, 2)
    if float(arg(node, 3, 0.0)) != 0.0:
        raise KeyError("dropout inside attention")
    if len(shape_of(q)) != 4 or len(shape_of(k)) != 4 or len(shape_of(v)) != 4:
        raise KeyError("attention over other than (batch, heads, seq, dim)")
    causal = bool(arg(node, 4, node.kwargs.get("is_causal", False)))
    sq = "s!" if causal else "s"
    operands, tokens = [q, k, v], [["b", "h", sq, "d!"], ["b", "h", "t!", "d!"], ["b", "h", "t!", "e!"]]
    _with_mask(node, operands, tokens, ["b", "h", sq, "t!"])
    return line(tokens, [["b", "h", sq, "e!"], ["b", "h", sq]]), "none", operands


def _with_mask(node: Node, operands: list[Node], tokens: list[list[str]], scores: list[str]) -> None:
    """An ``attn_mask=`` (keyword-only in the CPU kernels) as one more operand: a (…, s, t) tensor
    broadcast against the scores, so each of its dims is the scores' factor or, where its size is
    1, a broadcast ``1`` (a key-padding mask (b, 1, 1, t) splits with the batch)."""
    mask = node.kwargs.get("attn_mask")
    if mask is None:
        return
    if not isinstance(mask, Node):
        raise KeyError("attn_mask that is not a traced tensor")
    shape = shape_of(mask)
    if len(shape) > 4:
        raise KeyError("attn_mask of more than 4 dims")
    operands.append(mask)
    tokens.append(["1" if n == 1 else t for n, t in zip(shape, scores[4 - len(shape) :], strict=True)])


def flash_attention_backward(node: Node) -> Built:
    """_scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, dropout_p,
    is_causal) -> (grad_q, grad_k, grad_v): batch and heads pass through. grad_q keeps the query
    sequence and grad_k/grad_v sum over it, so it stays whole. Linear in grad (out and lse are the
    forward's, fixed): dS = P∘(g·vᵀ − rowsum(g∘out)), grad_q = dS·k, grad_k = dSᵀ·q, grad_v = Pᵀ·g."""
    g, q, k, v, out, lse = (arg(node, j) for j in range(6))
    if float(arg(node, 6, 0.0)) != 0.0:
        raise KeyError("dropout inside attention")
    qt, kt, vt = ["b", "h", "s!", "d!"], ["b", "h", "t!", "d!"], ["b", "h", "t!", "e!"]
    ot = ["b", "h", "s!", "e!"]
    operands, tokens = [g, q, k, v, out, lse], [ot, qt, kt, vt, ot, ["b", "h", "s!"]]
    _with_mask(node, operands, tokens, ["b", "h", "s!", "t!"])
    return line(tokens, [qt, kt, vt]), "first", operands


def adamw(node: Node) -> Built:
    """shardspec::adamw(p, g, m, v, step, ...) -> (p, m, v): elementwise over the four tensors of
    one shape, the step a 0-dim replicated count. Not linear in anything (v squares g, the update
    divides by sqrt(v))."""
    p, g, m, v, step = (arg(node, k) for k in range(5))
    names = letters(len(shape_of(p)))
    return line([names] * 4 + [[]], [names] * 3), "none", [p, g, m, v, step]


def efficient_attention(node: Node) -> Built:
    """_scaled_dot_product_efficient_attention(q, k, v, bias, compute_lse, dropout_p, is_causal)
    -> (out, lse, philox_seed, philox_offset), the CUDA kernel: as the CPU flash kernel, except that
    the query sequence stays whole (lse pads it to the kernel's block size, its own whole factor) and
    the philox seed and offset are 0-dim values every rank computes alike."""
    q, k, v = arg(node, 0), arg(node, 1), arg(node, 2)
    if arg(node, 3) is not None or float(arg(node, 5, 0.0)) != 0.0:
        raise KeyError("attention with a bias or dropout")
    if len(shape_of(q)) != 4 or len(shape_of(k)) != 4 or len(shape_of(v)) != 4:
        raise KeyError("attention over other than (batch, heads, seq, dim)")
    return (
        line(
            [["b", "h", "s!", "d!"], ["b", "h", "t!", "d!"], ["b", "h", "t!", "e!"]],
            [["b", "h", "s!", "e!"], ["b", "h", "u!"], [], []],
        ),
        "none",
        [q, k, v],
    )


def efficient_attention_backward(node: Node) -> Built:
    """_scaled_dot_product_efficient_attention_backward(grad, q, k, v, bias, out, lse, seed,
    offset, dropout_p, grad_input_mask, is_causal) -> (grad_q, grad_k, grad_v, grad_bias): batch
    and heads pass through, both sequences and the head dims stay whole; linear in grad (as the CPU
    flash backward)."""
    g, q, k, v, bias, out, lse, seed, offset = (arg(node, j) for j in range(9))
    if bias is not None or float(arg(node, 9, 0.0)) != 0.0:
        raise KeyError("attention with a bias or dropout")
    qt, kt, vt = ["b", "h", "s!", "d!"], ["b", "h", "t!", "d!"], ["b", "h", "t!", "e!"]
    ot = ["b", "h", "s!", "e!"]
    return (
        line([ot, qt, kt, vt, ot, ["b", "h", "u!"], [], []], [qt, kt, vt, []]),
        "first",
        [g, q, k, v, out, lse, seed, offset],
    )
