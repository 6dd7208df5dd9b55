"""The estimator on the project's own GPT (``dsrun.models.gpt.GPT``): counts, shape, and activations."""
from __future__ import annotations

import pytest
import torch

from dsrun.estimate import count_parameters
from dsrun.estimate.activations import gpt_activation_bytes, gpt_block_activation_bytes
from dsrun.estimate.counting import meta_device
from dsrun.estimate.runspec import gpt_shape_of
from dsrun.models import gpt
from tests.unit.estimate.test_activations_buffers import _saved_bytes


def test_meta_counts_match_the_gpt_config_for_13b():
    config = dict(vocab_size=50257, block_size=2048, n_layer=40, n_head=40, n_embd=5120)
    with meta_device():
        model = gpt.GPT(**config)
    counts = count_parameters(model)
    assert counts.total == model.config.num_parameters() == 12_853_386_240
    assert counts.largest_layer == model.config.largest_layer_params()
    shape = gpt_shape_of(model, {})
    assert (shape.n_layer, shape.n_embd, shape.n_head, shape.vocab_size) == (40, 5120, 40, 50257)


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_activation_formula_matches_what_the_gpt_saves(positions):
    torch.manual_seed(0)
    b, s, h, a, v = 3, 64, 64, 4, 256
    model = gpt.GPT(vocab_size=v, block_size=s, n_layer=2, n_head=a, n_embd=h, positions=positions)
    shape = gpt_shape_of(model, {})
    assert shape.rotary == (positions == "rotary") and shape.flash_attention
    x = torch.randn(b, s, h, requires_grad=True)
    block = _saved_bytes(lambda: model.transformer.h[0](x), model)
    assert abs(gpt_block_activation_bytes(shape, b, s, 4) - block) / block < 0.01
    idx = torch.randint(0, v, (b, s))
    whole = _saved_bytes(lambda: model(idx, idx), model)
    acts = gpt_activation_bytes(shape, b, s, "fp32", checkpointing=False)
    saved_part = acts.total - acts.workspace - b * s * v * 12  # peak-only terms autograd does not save
    assert abs(saved_part - whole) / whole < 0.01


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_a_tensor_parallel_block_saves_its_share_of_the_heads_and_mlp_width(positions):
    from dsrun.tensor_parallel import TensorParallelLinear
    from dsrun.tensor_parallel.split import split_for_training

    torch.manual_seed(0)
    b, s, h, a, v = 3, 64, 64, 4, 256
    model = gpt.GPT(vocab_size=v, block_size=s, n_layer=1, n_head=a, n_embd=h, positions=positions)
    shape = gpt_shape_of(model, {})  # the unsplit shape, as the estimator reads it
    split_for_training(model, None, 0, 2)  # rank 0 of a TP=2 group
    for layer in model.modules():
        if isinstance(layer, TensorParallelLinear):
            # the group's collectives save nothing for backward (an identity forward, or a reduced copy), so one
            # rank's saved tensors are measured without a group
            layer.tp_size = 1
    x = torch.randn(b, s, h, requires_grad=True)
    block = _saved_bytes(lambda: model.transformer.h[0](x), model)
    predicted = gpt_activation_bytes(shape, b, s, "fp32", False, tensor_parallel_size=2).per_block
    assert predicted == gpt_block_activation_bytes(shape, b, s, 4, tp=2) < gpt_block_activation_bytes(shape, b, s, 4)
    assert abs(predicted - block) / block < 0.01, (predicted, block)
