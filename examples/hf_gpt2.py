"""A Hugging Face ``GPT2LMHeadModel`` trained with @sharded, data- and tensor-parallel, unmodified.

python -m examples.hf_gpt2                     # simulated mesh dp=2,tp=2
python -m examples.hf_gpt2 --mesh dp=4 --steps 2
torchrun --nproc-per-node 4 -m examples.hf_gpt2

The model is built from a small ``GPT2Config`` (nothing is downloaded; needs ``pip install -e
'.[hf]'``). Its parameters become a dict and the step calls the module through
``torch.func.functional_call``, so the model's own code runs inside the traced step. Specs come from
parameter-name patterns (``shardspec.match_specs``): GPT-2's ``Conv1D`` stores weights as (in, out),
so the MLP's first layer splits its output columns over ``tp`` and the second its input rows.
``--dropout 0.1`` trains with GPT-2's residual and embedding dropout on (``model.train()``): the masks
are drawn counter-based from a per-step key (``shardspec.random``), the same on every mesh. The run
ends by checking the sharded parameters against the same steps taken by the plain module.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python examples/hf_gpt2.py` as well as `python -m examples.hf_gpt2`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Any

import torch
import torch.nn.functional as F

import shardspec
from examples import _cli
from shardspec import P, optim, sharded

RULES = [
    (r"attn\.c_attn\.weight$", P(None, "tp")),  # q|k|v output columns
    (r"attn\.c_attn\.bias$", P("tp")),
    (r"attn\.c_proj\.weight$", P("tp", None)),
    (r"mlp\.c_fc\.weight$", P(None, "tp")),  # hidden units over tp
    (r"mlp\.c_fc\.bias$", P("tp")),
    (r"mlp\.c_proj\.weight$", P("tp", None)),  # partial sums reduced once
]
OPT = optim.adamw(lr=1e-3, eps=1e-6)


def build(layers: int = 2, seed: int = 0, dropout: float = 0.0) -> Any:
    """A small GPT-2 from its config (no download); ``dropout`` > 0 puts it in training mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    return model.train() if dropout else model.eval()


def params_of(model: Any) -> dict[str, torch.Tensor]:
    """The trainable tensors by name (the tied output head is ``wte`` itself, listed once)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def make_step(model: Any) -> Any:
    def loss_fn(
        params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor, key: Any
    ) -> Any:
        with shardspec.random.rng(key):  # dropout masks from this step's key
            logits = torch.func.functional_call(model, params, (tokens,)).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def step(params: Any, state: Any, tokens: torch.Tensor, targets: torch.Tensor, key: Any) -> Any:
        loss, grads = shardspec.value_and_grad(loss_fn)(params, tokens, targets, key)
        params, state = OPT.update(grads, state, params)
        return params, state, loss

    return step


def batch(step: int, vocab: int = 64, seq: int = 16, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = _cli.parser(__doc__, "dp=2,tp=2")
    ap.add_argument("--steps", type=_cli.positive, default=2)
    ap.add_argument("--layers", type=_cli.positive, default=2)
    ap.add_argument("--dropout", type=float, default=0.0, help="residual and embedding dropout")
    args = ap.parse_args(argv)  # unknown flags are an error
    mesh = _cli.make_mesh(args)
    say = _cli.say_fn(mesh)
    say(_cli.mode_line(mesh))

    model = build(args.layers, dropout=args.dropout)
    params = params_of(model)
    rules = RULES if "tp" in args.mesh else []
    pspec = shardspec.match_specs(params, rules, default=P())
    sspec = OPT.state_specs(pspec)
    bspec = P("dp") if "dp" in args.mesh else P()
    step = sharded(
        make_step(model), mesh=mesh, in_specs=(pspec, sspec, bspec, bspec, P()), out_specs=(pspec, sspec, P())
    )
    say(_cli.spec_table(params, pspec, mesh))
    state, base = OPT.init(params), shardspec.random.key(0)
    new_params, new_state = params, state
    for i in range(args.steps):
        new_params, new_state, loss = step(
            new_params, new_state, *batch(i), shardspec.random.fold_in(base, i)
        )
        say(f"step {i + 1}/{args.steps}: loss {_cli.full(loss).item():.4f}")

    plain = make_step(model)  # the same steps, unsharded, through the module itself
    ref_params, ref_state = params, state
    for i in range(args.steps):
        ref_params, ref_state, _ = plain(ref_params, ref_state, *batch(i), shardspec.random.fold_in(base, i))
    final = {k: _cli.full(v) for k, v in new_params.items()}
    torch.testing.assert_close(final, ref_params, rtol=1e-4, atol=1e-5)
    say(
        f"equivalent: the sharded GPT2LMHeadModel matches the unsharded one after {args.steps} steps "
        f"(largest difference {_cli.max_difference(final, ref_params):.1e})"
    )
    return {"params": final, "reference": ref_params, "loss": _cli.full(loss).item()}


if __name__ == "__main__":
    _cli.run(main)
