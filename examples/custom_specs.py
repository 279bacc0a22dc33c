"""Specs by parameter-name pattern: ``shardspec.match_specs(tree, [(regex, P), ...], default=P())``.

python -m examples.custom_specs                  # simulated mesh dp=2,tp=2
python -m examples.custom_specs --mesh dp=2,tp=2 --fsdp

A strategy is a statement about a model's naming scheme, so it is written once as rules and applied
to every parameter: the first rule whose regex matches (``re.search``) a parameter's dotted path
wins, and ``default`` covers the rest (without a default, a parameter no rule matches is an error
naming it). ``--fsdp`` adds ZeRO-3 over ``dp`` on top of the tensor-parallel rules.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python examples/custom_specs.py` as well as `python -m examples...`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Any

import torch

import shardspec
from examples import _cli
from examples.models import gpt
from examples.train_gpt import OPT, batch, make_step
from shardspec import P, ShardingError, sharded

MEGATRON = [
    (r"attn\.qkv\.(weight|bias)$", P("tp")),  # heads over tp (the fused qkv rows are head-major)
    (r"attn\.proj\.weight$", P(None, "tp")),  # its input columns: one partial sum, reduced once
    (r"mlp\.fc\.(weight|bias)$", P("tp")),  # hidden units over tp
    (r"mlp\.proj\.weight$", P(None, "tp")),
]
FSDP_TP = [
    (r"attn\.qkv\.weight$|mlp\.fc\.weight$", P("tp", "dp")),
    (r"attn\.proj\.weight$|mlp\.proj\.weight$", P("dp", "tp")),
    (r"attn\.qkv\.bias$|mlp\.fc\.bias$", P("tp")),
    (r"^(wte|wpe|head\.weight)$", P("dp")),
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = _cli.parser(__doc__, "dp=2,tp=2")
    ap.add_argument("--fsdp", action="store_true", help="also split parameters over dp (FSDP + TP)")
    ap.add_argument("--steps", type=_cli.positive, default=2)
    args = ap.parse_args(argv)  # unknown flags are an error
    if "tp" not in args.mesh or (args.fsdp and "dp" not in args.mesh):
        ap.error("these rules split over a 'tp' axis (and 'dp' with --fsdp): e.g. --mesh dp=2,tp=2")
    mesh = _cli.make_mesh(args)
    say = _cli.say_fn(mesh)
    say(_cli.mode_line(mesh))

    cfg = gpt.Config(layers=1)
    params = gpt.init(cfg)
    try:  # no default: a parameter no rule matches is named
        shardspec.match_specs(params, MEGATRON)
    except ShardingError as err:
        say(f"without default=: {str(err).splitlines()[0]}")
    pspec = shardspec.match_specs(params, FSDP_TP if args.fsdp else MEGATRON, default=P())
    say(_cli.spec_table(params, pspec, mesh))

    sspec = OPT.state_specs(pspec)
    bspec = P("dp") if "dp" in args.mesh else P()
    step = sharded(
        make_step(cfg), mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P())
    )
    new_params, new_state = params, OPT.init(params)
    ref_params, ref_state = params, OPT.init(params)
    for i in range(args.steps):
        new_params, new_state, loss = step(new_params, new_state, *batch(i, cfg))
        ref_params, ref_state, _ = make_step(cfg)(ref_params, ref_state, *batch(i, cfg))
        say(f"step {i + 1}/{args.steps}: loss {_cli.full(loss).item():.4f}")
    final = {k: _cli.full(v) for k, v in new_params.items()}
    torch.testing.assert_close(final, ref_params, rtol=1e-4, atol=1e-5)
    diff = _cli.max_difference(final, ref_params)
    say(f"equivalent: matches the unsharded steps (largest difference {diff:.1e})")
    return {"specs": pspec}


if __name__ == "__main__":
    _cli.run(main)
