"""Kernel injection on dsrun's GPT: the fused KV-cache path generates what full recomputation generates,
token for token, runs each new token through the blocks alone, and honours max/min_out_tokens,
triangular_masking and INT8."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dsrun
from dsrun.models.gpt import GPT
from dsrun.utils.errors import UserError

LAYERS, WIDTH = 2, 32


def gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 50, "block_size": 48, "n_layer": LAYERS, "n_head": 4, "n_embd": WIDTH,
                  **overrides}).eval()


def prompt(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(5))


def bound(logits: torch.Tensor) -> float:
    """Two fp32 evaluations of the same logits summing in different orders: 2 x (sequential sums 2L+1) x
    (longest sum 4d) x u, relative to max(1, |logit|)."""
    unit = torch.finfo(torch.float32).eps / 2
    return 2 * (2 * LAYERS + 1) * 4 * WIDTH * unit * max(1.0, logits.abs().max().item())


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_kv_cache_generation_equals_full_recomputation_token_for_token(positions):
    ids = prompt()
    plain = dsrun.init_inference(gpt(positions=positions), dtype="fp32")
    fused = dsrun.init_inference(gpt(positions=positions), dtype="fp32", replace_with_kernel_inject=True)
    want = plain.generate(ids, 30, temperature=0)
    got = fused.generate(ids, 30, temperature=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # sampling draws the same tokens from the same generator
    sampled = [engine.generate(ids, 20, temperature=0.9, top_k=10, generator=torch.Generator().manual_seed(3))
               for engine in (plain, fused)]
    torch.testing.assert_close(sampled[1], sampled[0], rtol=0, atol=0)
    # and the logits of every step agree with a full forward over the sequence so far
    cache = fused.fused.new_cache(ids.shape[0], ids.device)
    with torch.no_grad():
        steps = [fused.fused._logits(want[:, :7], cache, 0)[:, -1]]
        steps += [fused.fused._logits(want[:, p:p + 1], cache, p)[:, -1] for p in range(7, want.shape[1] - 1)]
        full = plain(want[:, :-1])[:, 6:]
    for position, step in enumerate(steps):
        assert (step - full[:, position]).abs().max().item() <= bound(full)


def test_each_new_token_goes_through_the_blocks_alone():
    seen = {"plain": [], "fused": []}
    for kind in seen:
        engine = dsrun.init_inference(gpt(), dtype="fp32", replace_with_kernel_inject=kind == "fused")
        engine.module.transformer["h"][0].attn.c_attn.register_forward_hook(
            lambda module, args, out, kind=kind: seen[kind].append(args[0].shape[1]))
        engine.generate(prompt(length=5), 4, temperature=0)
    assert seen["plain"] == [5, 6, 7, 8]  # the whole context again for every token
    assert seen["fused"] == [5, 1, 1, 1]  # the prompt once, then one position per token


def test_cache_size_follows_max_out_tokens():
    engine = dsrun.init_inference(gpt(), dtype="fp32", kernel_inject=True, max_out_tokens=20)
    cache = engine.fused.new_cache(batch=3, device=torch.device("cpu"))
    assert cache.keys.shape == (LAYERS, 3, 4, 20, WIDTH // 4)
    assert cache.nbytes() == 2 * LAYERS * 3 * 20 * WIDTH * 4


def test_max_and_min_out_tokens_bound_a_generation():
    fused = dsrun.init_inference(gpt(), dtype="fp32", kernel_inject=True, max_out_tokens=10)
    assert fused.generate(prompt(length=5), 6, temperature=0).shape[1] == 11  # the last token is never fed back
    with pytest.raises(UserError, match="max_new_tokens: 5 prompt tokens \\+ 7 new tokens exceed"):
        fused.generate(prompt(length=5), 7, temperature=0)
    fused = dsrun.init_inference(gpt(), dtype="fp32", kernel_inject=True, max_out_tokens=10, min_out_tokens=4)
    with pytest.raises(UserError, match="min_out_tokens"):
        fused.generate(prompt(length=8), 2, temperature=0)
    plain = dsrun.init_inference(gpt(), dtype="fp32", max_tokens=10)
    assert plain.generate(prompt(length=5), 5, temperature=0).shape[1] == 10
    with pytest.raises(UserError, match="max_out_tokens=10"):
        plain.generate(prompt(length=5), 6, temperature=0)


def test_triangular_masking_off_lets_the_prompt_attend_both_ways():
    ids = prompt()
    causal = dsrun.init_inference(gpt(n_layer=1), dtype="fp32", kernel_inject=True)(ids)
    both_ways = dsrun.init_inference(gpt(n_layer=1), dtype="fp32", kernel_inject=True, triangular_masking=False)(ids)
    # in one block the last position sees the whole prompt either way; the first sees the future only
    # without the mask
    assert (both_ways[:, -1] - causal[:, -1]).abs().max().item() <= bound(causal)
    assert (both_ways[:, 0] - causal[:, 0]).abs().max().item() > 100 * bound(causal)


def test_fused_forward_keeps_the_models_call_convention():
    ids = prompt()
    model = gpt()
    with torch.no_grad():
        loss_want = model(ids[:, :-1], ids[:, 1:]).item()
    fused = dsrun.init_inference(model, dtype="fp32", kernel_inject=True)
    loss, logits = fused(ids[:, :-1], ids[:, 1:], return_logits=True)
    assert abs(loss.item() - loss_want) <= bound(logits)
    assert abs(fused((ids[:, :-1], ids[:, 1:])).item() - loss_want) <= bound(logits)


def test_int8_weights_on_the_fused_path():
    ids = prompt()
    engine = dsrun.init_inference(gpt(), dtype=torch.int8, kernel_inject=True, quant={"weight": {"q_groups": 4}})
    assert engine.quantized_linears == 2 * LAYERS * 2
    assert {m.weight.dtype for b in engine.module.transformer["h"] for m in (b.attn.c_attn, b.mlp.c_proj)} == \
        {torch.int8}
    assert engine.module.transformer["h"][0].attn.c_attn.weight_scale.unique().numel() == 4
    tokens = engine.generate(ids, 10, temperature=0)
    plain = dsrun.init_inference(gpt(), dtype=torch.int8, quant={"weight": {"q_groups": 4}})
    np.testing.assert_array_equal(tokens.numpy(), plain.generate(ids, 10, temperature=0).numpy())
