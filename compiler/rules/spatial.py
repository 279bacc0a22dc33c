"""Rule builders for convolution, pooling, batch/group norm and upsampling: batch and channel dims
pass through (input channels of a convolution are a contraction), spatial dims stay whole."""

from __future__ import annotations

from torch.fx import Node

from compiler.rules.builders import Built, arg, shape_of
from compiler.rules.notation import line


def convolution(node: Node) -> Built:
    x, w, bias = arg(node, 0), arg(node, 1), arg(node, 2)
    transposed, groups = bool(arg(node, 6, False)), int(arg(node, 8, 1))
    spatial = len(shape_of(w)) - 2  # the weight is (out, in, *kernel): its rank fixes the spatial dims
    batch = ["n"] if len(shape_of(x)) == spatial + 2 else []
    sp_in = [f"s{k}!" for k in range(spatial)]
    sp_w = [f"k{k}!" for k in range(spatial)]
    sp_out = [f"t{k}!" for k in range(spatial)]
    c, o = ("c", "o") if groups == 1 else ("c!", "o!")
    if isinstance(bias, Node):
        c = "c!"  # split input channels leave a pending sum, and every device would add the bias
    wt = [c, o, *sp_w] if transposed else [o, c, *sp_w]
    operands, tokens = [x, w], [[*batch, c, *sp_in], wt]
    if isinstance(bias, Node):
        operands.append(bias)
        tokens.append([o])
    return line(tokens, [[*batch, o, *sp_out]]), "none", operands


def pooling(node: Node, spatial: int) -> Built:
    """avg/max/adaptive pooling and upsampling over ``spatial`` trailing dims, which stay whole;
    the leading (batch, channel) dims pass through, whether or not a batch dim is present."""
    x = arg(node, 0)
    n = len(shape_of(x))
    lead = [f"l{k}" for k in range(n - spatial)]
    ins = [*lead, *(f"s{k}!" for k in range(spatial))]
    vals = node.meta["val"]
    outs = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    otoks = [[*lead, *(f"o{j}{k}!" for k in range(v.dim() - len(lead)))] for j, v in enumerate(outs)]
    return line([ins], otoks), "none", [x]


def batch_norm(node: Node) -> Built:
    """native_batch_norm: statistics over batch and spatial dims, so only channels pass through."""
    x = arg(node, 0)
    n = len(shape_of(x))
    ins = ["n!", "c", *(f"s{k}!" for k in range(n - 2))]
    operands, tokens = [x], [ins]
    for a in node.args[1:5]:
        if isinstance(a, Node):
            operands.append(a)
            tokens.append(["c"])
    vals = node.meta["val"]
    outs = [ins] + [["c"] if v.dim() == 1 else [f"e{j}!" for j in range(v.dim())] for v in vals[1:]]
    return line(tokens, outs), "none", operands


def group_norm(node: Node) -> Built:
    """native_group_norm: statistics per (sample, group): the batch dim passes through."""
    x, w, b = arg(node, 0), arg(node, 1), arg(node, 2)
    n = len(shape_of(x))
    ins = ["n", "c!", *(f"s{k}!" for k in range(n - 2))]
    operands, tokens = [x], [ins]
    for a in (w, b):
        if isinstance(a, Node):
            operands.append(a)
            tokens.append(["c!"])
    return line(tokens, [ins, ["n", "g!"], ["n", "g!"]]), "none", operands


def convolution_backward(node: Node) -> Built:
    """convolution_backward(grad_out, input, weight, ..., output_mask) -> (grad_input, grad_weight,
    grad_bias): the forward's factors. The batch is a sum for grad_weight/grad_bias but passes
    through to grad_input, and the output channels the reverse; a rule has one set of reductions,
    so a factor that is not kept by every requested result, or summed by every one, stays whole."""
    g, x, w = arg(node, 0), arg(node, 1), arg(node, 2)
    transposed, groups, mask = bool(arg(node, 7)), int(arg(node, 9)), list(arg(node, 10))
    spatial = len(shape_of(w)) - 2
    batch = ["n"] if len(shape_of(x)) == spatial + 2 else []
    sp_in, sp_w, sp_out = ([f"{p}{k}!" for k in range(spatial)] for p in ("s", "k", "t"))
    c, o = ("c", "o") if groups == 1 else ("c!", "o!")
    wt = [c, o, *sp_w] if transposed else [o, c, *sp_w]
    results = [[*batch, c, *sp_in], wt, [o]]
    sums = [{"o"}, {"n"}, {"n"}]  # what each result adds up over
    asked = [({t.rstrip("!") for t in r}, s) for r, s, m in zip(results, sums, mask, strict=True) if m]
    # a factor must be kept by every asked result or summed by every one; a result that neither
    # keeps nor sums it (grad_bias and the input channels) would be counted once per device
    mixed = {
        f for f in ("n", "c", "o") if not all(f in k for k, _ in asked) and not all(f in s for _, s in asked)
    }

    def mark(ts: list[str]) -> list[str]:
        return [t + "!" if t in mixed else t for t in ts]

    outs = [mark(r) if m else [] for r, m in zip(results, mask, strict=True)]
    operands = [mark([*batch, o, *sp_out]), mark([*batch, c, *sp_in]), mark(wt)]
    return line(operands, outs), "first", [g, x, w]


def avg_pool_backward(node: Node) -> Built:
    """avg_pool2d/3d_backward(grad, x, ...): (batch, channel) pass through; linear in grad."""
    grad, x = arg(node, 0), arg(node, 1)
    n, spatial = len(shape_of(x)), len(arg(node, 2))
    lead = [f"l{k}" for k in range(n - spatial)]
    g = [*lead, *(f"g{k}!" for k in range(spatial))]
    s = [*lead, *(f"s{k}!" for k in range(spatial))]
    return line([g, s], [s]), "first", [grad, x]


def upsample_backward(node: Node, spatial: int) -> Built:
    """upsample_*_backward(grad, output_size, input_size, ...): (batch, channel) pass through, the
    resampled dims stay whole; linear in grad."""
    grad = arg(node, 0)
    n = len(shape_of(grad))
    lead = [f"l{k}" for k in range(n - spatial)]
    g = [*lead, *(f"g{k}!" for k in range(spatial))]
    s = [*lead, *(f"s{k}!" for k in range(spatial))]
    return line([g], [s]), "first", [grad]


def pad_backward(node: Node, spatial: int) -> Built:
    """reflection/replication_pad*_backward(grad, x, padding) and _adaptive_avg_pool*_backward(grad,
    x): (batch, channel) pass through, the spatial dims stay whole; linear in grad."""
    grad, x = arg(node, 0), arg(node, 1)
    n = len(shape_of(x))
    lead = [f"l{k}" for k in range(n - spatial)]
    g = [*lead, *(f"g{k}!" for k in range(spatial))]
    s = [*lead, *(f"s{k}!" for k in range(spatial))]
    return line([g, s], [s]), "first", [grad, x]


def pool_grad(node: Node, spatial: int, idx_arg: int) -> Built:
    """max_pool*_with_indices_backward / adaptive_max_pool*_backward(grad, x, ..., indices):
    (batch, channel) pass through, the pooled dims stay whole; linear in grad."""
    grad, x, idx = arg(node, 0), arg(node, 1), arg(node, idx_arg)
    n = len(shape_of(x))
    lead = [f"l{k}" for k in range(n - spatial)]
    g = [*lead, *(f"g{k}!" for k in range(spatial))]
    s = [*lead, *(f"s{k}!" for k in range(spatial))]
    return line([g, s, g], [s]), "first", [grad, x, idx]
