"""Hugging Face models (the optional ``hf`` extra) trained under ``value_and_grad`` with padded
batches: loss and gradients equal the unsharded step's.

transformers skips its mask-value checks while a graph is traced (``is_tracing``: dynamo, a
FakeTensor, an fx.Proxy); inside ``value_and_grad`` the tensors are functorch wrappers it does not
recognise, so it read the mask's values and the step was refused until the trace set
``torch.compiler.is_compiling()`` as torch.export's non-strict tracing does.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import shardspec
from shardspec import Mesh, P, sharded

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4, use_cache=False
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> Any:
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


@pytest.mark.parametrize("make", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_padded_batch_under_value_and_grad_matches_unsharded(make: Any) -> None:
    torch.manual_seed(0)
    model = make().eval()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    tok = torch.randint(0, 64, (4, 8))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, -2:] = 0  # a padded sequence
    labels = tok.masked_fill(mask == 0, -100)

    def loss(p: Any, tok: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (tok,), {"attention_mask": mask, "labels": labels})
        return out.loss

    def step(p: Any, tok: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> Any:
        return shardspec.value_and_grad(loss)(p, tok, mask, labels)

    rep = {k: P() for k in params}
    mesh = Mesh({"dp": 2}, simulate=True)
    f = sharded(step, mesh=mesh, in_specs=(rep, P("dp"), P("dp"), P("dp")), out_specs=(P(), rep))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got_loss, got_grads = f(params, tok, mask, labels)
    grads, want_loss = torch.func.grad_and_value(loss)(params, tok, mask, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for k in params:
        torch.testing.assert_close(got_grads[k], grads[k], rtol=1e-4, atol=1e-5, msg=k)


_POST_SCALE = torch.tensor(1.0)
_POST_DROP = torch.nn.Dropout(0.5)


class _Scaler:
    def go(self, loss: torch.Tensor) -> torch.Tensor:
        return _POST_DROP(loss.expand(64)) * _POST_SCALE


class _Head:
    def __init__(self) -> None:
        self.c0 = _Scaler()

    def run(self, loss: torch.Tensor) -> torch.Tensor:
        return self.c0.go(loss)


def test_the_closed_over_search_reaches_past_an_hf_model() -> None:
    """With an HF model in the step the search for closed-over tensors stopped after 4,096
    expansions (transformers' modules expanded again for every new name), so a helper reached
    after it was not checked: a rebound global gave the old value and .eval() kept dropout."""
    global _POST_SCALE
    model = _gpt2().eval()  # its own dropout off: the helper's dropout is the one switched
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    tok = torch.randint(0, 64, (4, 8))
    head = _Head()

    def post(loss: torch.Tensor) -> torch.Tensor:
        return head.run(loss)

    def step(p: Any, tok: torch.Tensor) -> torch.Tensor:
        return post(torch.func.functional_call(model, p, (tok,), {"labels": tok}).loss)

    f = sharded(
        step, mesh=Mesh({"dp": 2}, simulate=True), in_specs=({k: P() for k in params}, P("dp")), out_specs=P()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f(params, tok)
        _POST_DROP.eval()
        torch.testing.assert_close(f(params, tok), step(params, tok))  # eval: no dropout
        _POST_SCALE = torch.tensor(100.0)
        with pytest.raises(shardspec.ShardingError, match="_POST_SCALE was set"):
            f(params, tok)
