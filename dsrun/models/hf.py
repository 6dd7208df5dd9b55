"""The built-in GPT in a Hugging Face layout: GPT-2's (``GPT2LMHeadModel``) with learned positions, GPT-NeoX's
(``GPTNeoXForCausalLM``) with rotary ones; its ``config.json`` and its tensors.

dsrun's GPT is GPT-2's architecture with GPT-2's module names (:mod:`dsrun.models.layers`), so a checkpoint maps
over name for name. What differs, and what the export therefore writes:

- GPT-2's projections are ``Conv1D`` layers, ``y = x @ W + b`` with ``W`` stored ``[in, out]``: each
  ``nn.Linear`` weight (``[out, in]``) of ``c_attn``, ``c_proj`` and ``c_fc`` is written transposed;
- the MLP's activation is the exact (erf) GELU, ``F.gelu``: ``activation_function="gelu"``, not GPT-2's default
  ``gelu_new`` (the tanh approximation, which differs by up to ~1e-3);
- the LayerNorms' epsilon is :data:`~dsrun.models.layers.LAYER_NORM_EPS`; attention is scaled by
  ``1/sqrt(head_size)`` (``scale_attn_weights``, neither per-layer scaling nor reordering); the three dropouts
  are the model's ``dropout`` (a loaded model is in eval mode, where they do nothing);
- ``bias=False``: GPT-2 always has biases, so zero ones are written (adding an exact zero changes no bit);
- the output head is tied to the token table (``tie_word_embeddings``, the head not stored) or written as
  ``lm_head.weight``;
- the vocabulary is the model's, with no special tokens (``bos_token_id``/``eos_token_id`` null: dsrun's GPT
  has none; a tokenizer's belong with the tokenizer).

Rotary positions: GPT-2 adds a learned table, so a rotary GPT is written as GPT-NeoX, which computes the same
block when told to: sequential residuals (``use_parallel_residual=False``), every dimension rotated
(``partial_rotary_factor=1``, NeoX's default is 1/4) with ``rope_theta`` the GPT's ``rotary_base``, the exact GELU,
the same epsilon. NeoX rotates halves as dsrun does (``q*cos + rotate_half(q)*sin``: the same products and sums)
and holds each head's query, key and value rows together, so ``c_attn``'s rows are regrouped per head
(``[3, H, hs]`` to ``[H, 3, hs]``); its MLP always has biases (zeros when ``bias=False``); an untied head is
``embed_out.weight`` (the hub's name, which transformers 5 reads as ``lm_head``).

Refused, naming the option (:func:`hf_refusal`): block-sparse attention (both families attend densely) and a
pipelined GPT's layer files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping

import torch

from dsrun.models.config import GPTConfig
from dsrun.models.gpt import INIT_STD
from dsrun.models.layers import LAYER_NORM_EPS
from dsrun.utils.errors import Problem

# the nn.Linear layers of a block, which GPT-2 holds as Conv1D (weights transposed)
CONV1D_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# GPT-NeoX's name of each dsrun name (a block's part after ``transformer.h.N.``, or a whole name outside blocks)
NEOX_NAMES = {"transformer.wte": "gpt_neox.embed_in", "transformer.ln_f": "gpt_neox.final_layer_norm",
              "lm_head": "embed_out", "ln_1": "input_layernorm", "attn.c_attn": "attention.query_key_value",
              "attn.c_proj": "attention.dense", "ln_2": "post_attention_layernorm", "mlp.c_fc": "mlp.dense_h_to_4h",
              "mlp.c_proj": "mlp.dense_4h_to_h"}


@dataclass(frozen=True)
class HFModel:
    """A model as Hugging Face's ``save_pretrained`` writes it: ``config.json``'s contents and the tensors of
    ``model.safetensors`` by name (a tied weight's alias left out, as ``save_pretrained`` does)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def hf_refusal(config: GPTConfig) -> Problem | None:
    """Why a GPT of ``config`` has no exact Hugging Face counterpart (the option, what is missing), or None."""
    if config.attention != "dense":
        return Problem("model.attention", f"{config.attention!r}: GPT-2's and GPT-NeoX's attention is dense, so "
                       "their logits would not be this model's", "export a GPT trained with model.attention=dense")
    if config.pipeline_stages > 1:
        return Problem("model.pipeline_stages", f"{config.pipeline_stages}: a pipelined GPT keeps its weights in "
                       "per-layer files under the pipeline's layer names", "export a GPT trained without pipeline "
                       "stages, or load the pipeline checkpoint into a GPT and save that")
    return None


def hf_layout(config: GPTConfig) -> str:
    """The Hugging Face family a GPT of ``config`` is written as."""
    return "GPT-2" if config.positions == "learned" else "GPT-NeoX"


def gpt2_config(config: GPTConfig) -> dict[str, Any]:
    """``config.json`` of the ``GPT2LMHeadModel`` that computes what ``GPT(config)`` computes."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": 4 * config.n_embd,
        "activation_function": "gelu",
        "resid_pdrop": float(config.dropout),
        "embd_pdrop": float(config.dropout),
        "attn_pdrop": float(config.dropout),
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": INIT_STD,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(config.tie_embeddings),
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "dtype": "float32",
    }


def gpt_state_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The state-dict keys of ``GPT(config)`` and their shapes, in its order (the head's included even when
    tied)."""
    d = config.n_embd
    weights = {"ln_1": (d,), "attn.c_attn": (3 * d, d), "attn.c_proj": (d, d), "ln_2": (d,),
               "mlp.c_fc": (4 * d, d), "mlp.c_proj": (d, 4 * d)}
    shapes: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (config.vocab_size, d)}
    if config.positions == "learned":
        shapes["transformer.wpe.weight"] = (config.block_size, d)
    layers = [(f"transformer.h.{index}.{layer}", shape) for index in range(config.n_layer)
              for layer, shape in weights.items()] + [("transformer.ln_f", (d,))]
    for layer, shape in layers:
        shapes[f"{layer}.weight"] = shape
        if config.bias:
            shapes[f"{layer}.bias"] = shape[:1]
    shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def key_differences(expected: Mapping[str, tuple[int, ...]], actual: Mapping[str, torch.Tensor],
                    optional: Collection[str] = ()) -> str | None:
    """How the tensors ``actual`` differ from the names and shapes ``expected`` (the first three of the missing,
    unexpected and mis-shaped ones), or None. Names in ``optional`` may be absent (a tied weight's second name)."""
    missing = [name for name in expected if name not in actual and name not in optional]
    unexpected = [name for name in actual if name not in expected]
    misshaped = [f"{name} {list(actual[name].shape)} (expected {list(shape)})" for name, shape in expected.items()
                 if name in actual and tuple(actual[name].shape) != tuple(shape)]
    found = [f"{what} {', '.join(names[:3])}" + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
             for what, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if names]
    return "; ".join(found) or None


def _with_zero_biases(config: GPTConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with a zero bias after each weight of a layer that has none (``bias=False``); the target
    families' layers always have one. The output head and the tables have none in either."""
    if config.bias:
        return tensors
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        out[name] = tensor
        if name.endswith(".weight") and "wte" not in name and "wpe" not in name and "embed" not in name \
                and "lm_head" not in name:
            out[name[:-len("weight")] + "bias"] = torch.zeros(tensor.shape[0], dtype=tensor.dtype)
    return out


def gpt_to_gpt2(config: GPTConfig, state: Mapping[str, torch.Tensor]) -> HFModel:
    """The ``GPT2LMHeadModel`` holding the weights ``state`` of a ``GPT(config)`` with learned positions (checked
    beforehand: :func:`hf_refusal`, :func:`key_differences` against :func:`gpt_state_shapes`). Tensors are the
    given ones (transposed ones copied contiguous), in the GPT's key order."""
    tensors: dict[str, torch.Tensor] = {}
    for name in gpt_state_shapes(config):
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # tied: GPT-2 reads the token table (save_pretrained leaves the head out too)
        tensors[name] = state[name]
    tensors = _with_zero_biases(config, tensors)  # zero biases are [out], as Linear's and Conv1D's are
    for name, tensor in tensors.items():
        if name.endswith(".weight") and ".".join(name.split(".")[-3:-1]) in CONV1D_LAYERS:
            tensors[name] = tensor.t().contiguous()
    return HFModel(gpt2_config(config), tensors)


def gpt_neox_config(config: GPTConfig) -> dict[str, Any]:
    """``config.json`` of the ``GPTNeoXForCausalLM`` that computes what a rotary ``GPT(config)`` computes."""
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "intermediate_size": 4 * config.n_embd,
        "hidden_act": "gelu",
        "max_position_embeddings": config.block_size,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rotary_base),
                            "partial_rotary_factor": 1.0},
        "rotary_pct": 1.0,  # what transformers 4 reads for the two above
        "rotary_emb_base": float(config.rotary_base),
        "use_parallel_residual": False,
        "attention_bias": True,
        "attention_dropout": float(config.dropout),
        "hidden_dropout": float(config.dropout),
        "layer_norm_eps": LAYER_NORM_EPS,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": bool(config.tie_embeddings),
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "dtype": "float32",
    }


def _neox_name(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["transformer", "h"]:
        block, layer, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        return f"gpt_neox.layers.{block}.{NEOX_NAMES[layer]}.{kind}"
    return f"{NEOX_NAMES['.'.join(parts[:-1])]}.{parts[-1]}"


def gpt_to_gpt_neox(config: GPTConfig, state: Mapping[str, torch.Tensor]) -> HFModel:
    """The ``GPTNeoXForCausalLM`` holding the weights ``state`` of a rotary ``GPT(config)`` (checked as for
    :func:`gpt_to_gpt2`): names mapped, ``c_attn``'s rows regrouped per head."""
    heads, size = config.n_head, config.head_size
    tensors: dict[str, torch.Tensor] = {}
    for name in gpt_state_shapes(config):
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        tensors[name] = state[name]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _with_zero_biases(config, tensors).items():
        if ".attn.c_attn." in name:  # rows [q heads | k heads | v heads] -> per head [q | k | v]
            tensor = tensor.reshape(3, heads, size, -1).transpose(0, 1).reshape(tensor.shape).contiguous()
        out[_neox_name(name)] = tensor
    return HFModel(gpt_neox_config(config), out)


def gpt_to_hf(config: GPTConfig, state: Mapping[str, torch.Tensor]) -> HFModel:
    """The Hugging Face model (:func:`hf_layout`'s family) holding the weights ``state`` of a ``GPT(config)``."""
    return gpt_to_gpt2(config, state) if hf_layout(config) == "GPT-2" else gpt_to_gpt_neox(config, state)
