"""Kernel injection on Hugging Face models (``init_inference(replace_with_kernel_inject=True)``): each family's
blocks become DeepSpeed's injected layer and the model computes what it computed before.

Models are built from small configs with random weights (2 blocks); the tolerance is fp32 rounding: the
injected layer sums the same products in another order (``fp32_bound``).
"""
from __future__ import annotations

import copy

import pytest
import torch

import dsrun
from dsrun.inference.injection import DeepSpeedTransformerInference
from dsrun.utils.errors import ConfigError

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS = 61, 2


def build(family: str) -> torch.nn.Module:
    t = transformers
    decoder = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    configs = {
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(n_layer=LAYERS, n_head=4, n_embd=32, n_positions=64,
                                                       **decoder)),
        # scores scaled by 1 / (layer index + 1): the index in the model, not a count over the process
        "gpt2-layer-scaled": lambda: t.GPT2LMHeadModel(t.GPT2Config(n_layer=LAYERS, n_head=4, n_embd=32, n_positions=64,
                                                                    scale_attn_by_inverse_layer_idx=True, **decoder)),
        "opt": lambda: t.OPTForCausalLM(t.OPTConfig(num_hidden_layers=LAYERS, num_attention_heads=4, hidden_size=32,
                                                    ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32,
                                                    **decoder)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=4,
                                                          num_key_value_heads=2, hidden_size=32, intermediate_size=48,
                                                          max_position_embeddings=64, **decoder)),
        "gptneo": lambda: t.GPTNeoForCausalLM(t.GPTNeoConfig(num_layers=LAYERS, num_heads=4, hidden_size=32,
                                                             max_position_embeddings=64, window_size=3,
                                                             attention_types=[[["global", "local"], 1]], **decoder)),
        "gptj": lambda: t.GPTJForCausalLM(t.GPTJConfig(n_layer=LAYERS, n_head=4, n_embd=32, n_positions=64,
                                                       rotary_dim=4, **decoder)),
        # BERT with the tanh GELU: DeepSpeed's GELU kernel is the tanh approximation (docs/inference.md)
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(num_hidden_layers=LAYERS, num_attention_heads=4, hidden_size=32,
                                                       intermediate_size=64, max_position_embeddings=64,
                                                       vocab_size=VOCAB, hidden_act="gelu_new")),
    }
    torch.manual_seed(0)
    return configs[family]().eval()


def fp32_bound(model: torch.nn.Module, reference: torch.Tensor) -> float:
    """Each dot product of length n carries at most n·u relative rounding; a block has six products in a row
    (query/key/value, scores, context, output, intermediate, MLP output), the head one more; norms keep the
    residual stream of order 1, so the bound is relative to max(1, |logit|)."""
    longest = max(max(p.shape) for p in model.parameters() if p.dim() == 2 and max(p.shape) < VOCAB)
    unit = torch.finfo(torch.float32).eps / 2
    return 2 * (6 * LAYERS + 1) * longest * unit * max(1.0, reference.abs().max().item())


def prompt(batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["gpt2", "gpt2-layer-scaled", "opt", "llama", "gptneo", "gptj", "bert"])
def test_injected_blocks_give_the_original_logits(family):
    model = build(family)
    original = type(next(m for m in model.modules() if type(m).__name__.endswith(("Block", "Layer"))))
    ids = prompt(length=9)  # longer than GPT-Neo's local window of 3
    with torch.no_grad():
        reference = model(ids).logits
    engine = dsrun.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    assert engine.injected_layers == LAYERS
    assert sum(isinstance(m, DeepSpeedTransformerInference) for m in engine.module.modules()) == LAYERS
    assert not any(type(m) is original for m in engine.module.modules())
    got = engine(ids).logits
    assert (got - reference).abs().max().item() <= fp32_bound(model, reference)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gptj"])
def test_generation_and_cached_decoding_match_the_original(family):
    model = build(family)
    reference_model = copy.deepcopy(model)
    ids = prompt()
    expected = reference_model.generate(ids, max_new_tokens=6, do_sample=False)
    engine = dsrun.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    assert torch.equal(engine.generate(ids, max_new_tokens=6, do_sample=False), expected)
    # a padded batch: left padding masks the pad keys out of the injected attention as out of the original
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = reference_model(ids, attention_mask=mask).logits
    got = engine(ids, attention_mask=mask).logits
    assert (got[0, 3:] - want[0, 3:]).abs().max().item() <= fp32_bound(model, want)
    assert (got[1] - want[1]).abs().max().item() <= fp32_bound(model, want)


def test_the_layer_keeps_its_keys_and_values_between_calls_as_deepspeeds_does():
    model = build("gpt2")
    engine = dsrun.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    layer = engine.module.transformer.h[0]
    hidden = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2))
    whole = layer(hidden)  # a prompt: keys and values kept in layer.layer_past
    assert layer.layer_past[0].shape == (1, 4, 5, 8)
    layer(hidden[:, :4])
    step = layer(hidden[:, 4:])  # one token: attends over the 4 kept positions and itself
    assert layer.layer_past[0].shape == (1, 4, 5, 8)
    assert (step - whole[:, 4:]).abs().max().item() <= 1e-5 * max(1.0, whole.abs().max().item())
    DeepSpeedTransformerInference.reset_cache()
    assert layer.layer_past is None


def test_a_family_without_a_policy_and_int8_injection_are_refused():
    config = transformers.GPTNeoXConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                        intermediate_size=32, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="replace_with_kernel_inject: DeepSpeed would swap its injected layer into "
                                          "GPTNeoXForCausalLM's GPTNeoXLayer layers"):
        dsrun.init_inference(transformers.GPTNeoXForCausalLM(config), kernel_inject=True)
    with pytest.raises(ConfigError, match="init_inference.dtype: INT8 with kernel injection"):
        dsrun.init_inference(build("gpt2"), kernel_inject=True, dtype=torch.int8)


def test_replace_transformer_layer_injects_the_named_block_class_only():
    from dsrun.inference.config import merge_config

    model = build("gpt2")
    ids = prompt()
    with torch.no_grad():
        reference = model(ids).logits
    block = type(model.transformer.h[0])
    assert dsrun.replace_transformer_layer(torch.nn.LayerNorm, model, None, merge_config(None)) is model
    assert type(model.transformer.h[0]) is block  # a class no policy names: nothing replaced
    dsrun.replace_transformer_layer(block, model, None, merge_config(None, dtype=torch.float32))
    assert all(isinstance(layer, DeepSpeedTransformerInference) for layer in model.transformer.h)
    with torch.no_grad():
        got = model(ids).logits
    assert (got - reference).abs().max().item() <= fp32_bound(model, reference)
