"""A model written with einops (rearrange / reduce / einsum), trained data- and tensor-parallel.

python -m examples.einops_model                  # simulated mesh dp=2,tp=2
python -m examples.einops_model --mesh tp=4 --steps 2
torchrun --nproc-per-node 4 -m examples.einops_model

einops calls trace into ordinary reshapes, permutes and matmuls, so the compiler sees through them:
the head-major qkv rows and the first MLP layer split over ``tp``, their partners' input columns
too, and the batch over ``dp``. The run ends by checking the result against the unsharded steps.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python examples/einops_model.py` as well as `python -m examples...`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Any

import torch

import shardspec
from examples import _cli
from examples.models import einops_vit as vit
from shardspec import P, optim, sharded

RULES = [
    (r"qkv\.weight$", P("tp", None)),  # heads over tp
    (r"out\.weight$", P(None, "tp")),
    (r"fc1\.weight$", P("tp", None)),  # hidden units over tp
    (r"fc2\.weight$", P(None, "tp")),
]
OPT = optim.adamw(lr=1e-2)


def make_step(cfg: vit.Config) -> Any:
    def step(params: Any, state: Any, images: torch.Tensor, labels: torch.Tensor) -> Any:
        loss, grads = shardspec.value_and_grad(vit.loss_fn)(params, images, labels, cfg)
        params, state = OPT.update(grads, state, params)
        return params, state, loss

    return step


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = _cli.parser(__doc__, "dp=2,tp=2")
    ap.add_argument("--steps", type=_cli.positive, default=3)
    args = ap.parse_args(argv)  # unknown flags are an error
    mesh = _cli.make_mesh(args)
    say = _cli.say_fn(mesh)
    say(_cli.mode_line(mesh))

    cfg = vit.Config()
    params = vit.init(cfg)
    pspec = shardspec.match_specs(params, RULES if "tp" in args.mesh else [], default=P())
    sspec = OPT.state_specs(pspec)
    bspec = P("dp") if "dp" in args.mesh else P()
    step = sharded(
        make_step(cfg), mesh=mesh, in_specs=(pspec, sspec, bspec, bspec), out_specs=(pspec, sspec, P())
    )
    g = torch.Generator().manual_seed(0)
    images, labels = (
        torch.randn(8, cfg.image, cfg.image, generator=g),
        torch.randint(0, cfg.classes, (8,), generator=g),
    )

    state = OPT.init(params)
    new_params, new_state = params, state
    for i in range(args.steps):
        new_params, new_state, loss = step(new_params, new_state, images, labels)
        say(f"step {i + 1}/{args.steps}: loss {_cli.full(loss).item():.4f}")
    ref_params, ref_state = params, state
    for _ in range(args.steps):
        ref_params, ref_state, _ = make_step(cfg)(ref_params, ref_state, images, labels)
    final = {k: _cli.full(v) for k, v in new_params.items()}
    torch.testing.assert_close(final, ref_params, rtol=1e-4, atol=1e-5)
    diff = _cli.max_difference(final, ref_params)
    say(f"equivalent: matches the unsharded steps (largest difference {diff:.1e})")
    return {"params": final, "reference": ref_params}


if __name__ == "__main__":
    _cli.run(main)
