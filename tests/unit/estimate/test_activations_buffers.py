"""Activation and buffer formulas: the published closed form, autograd's own saved tensors, and the caps."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dsrun.estimate.activations import (
    gpt_activation_bytes,
    gpt_block_activation_bytes,
    gpt_head_activation_bytes,
)
from dsrun.estimate.buffers import buffer_bytes
from dsrun.estimate.inputs import BufferSettings, EstimateInputs, GPTShape
from dsrun.profiling.tensor_memory import SavedTensorBytes
from tests.unit.estimate.tiny_gpt import TinyGPT


def test_block_matches_korthikanti_closed_form():
    # 16-bit, dropout, explicit attention: s*b*h*(34 + 5*a*s/h), plus our fp32 LayerNorm statistics (16*s*b).
    b, s, h, a = 2, 512, 1024, 16
    shape = GPTShape(n_layer=1, n_embd=h, n_head=a, vocab_size=1000, flash_attention=False, dropout=True)
    expected = s * b * h * 34 + 5 * a * s * s * b + 16 * s * b
    assert gpt_block_activation_bytes(shape, b, s, elem=2) == expected


def _saved_bytes(fn, module: torch.nn.Module) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while running ``fn``."""
    with SavedTensorBytes(exclude=module.parameters()) as saved:
        fn()
    return saved.bytes


@pytest.mark.parametrize("flash", [True, False])
def test_block_formula_matches_what_autograd_saves(flash):
    torch.manual_seed(0)
    b, s, h, a = 3, 32, 64, 4
    model = TinyGPT(vocab_size=128, block_size=s, n_layer=1, n_head=a, n_embd=h, flash=flash)
    x = torch.randn(b, s, h, requires_grad=True)
    measured = _saved_bytes(lambda: model.h[0](x), model)
    predicted = gpt_block_activation_bytes(GPTShape(1, h, a, 128, flash_attention=flash), b, s, elem=4)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_whole_model_saved_tensors_are_within_the_peak_formula():
    # Beyond what autograd saves, the peak also counts the logits the caller holds and the two fp32
    # gradients at the loss (b*s*V*(4 + 4 + 4) bytes in fp32) and the backward workspace.
    b, s, h, a, v, layers = 2, 32, 64, 4, 256, 3
    model = TinyGPT(vocab_size=v, block_size=s, n_layer=layers, n_head=a, n_embd=h)
    idx = torch.randint(0, v, (b, s))
    measured = _saved_bytes(lambda: model(idx, idx), model)
    acts = gpt_activation_bytes(GPTShape(layers, h, a, v), b, s, "fp32", checkpointing=False)
    not_saved = b * s * v * 12 + acts.workspace
    assert acts.workspace == 2 * 4 * b * s * 4 * h
    assert abs((acts.total - not_saved) - measured) / measured < 0.02, (acts.total - not_saved, measured)


def test_checkpointing_keeps_only_block_inputs_plus_one_block():
    b, s, h, a, layers = 2, 32, 64, 4, 4
    model = TinyGPT(vocab_size=128, block_size=s, n_layer=layers, n_head=a, n_embd=h)
    x = torch.randn(b, s, h, requires_grad=True)

    def run_checkpointed():
        y = x
        for block in model.h:
            y = checkpoint(block, y, use_reentrant=False)
        return y

    measured = _saved_bytes(run_checkpointed, model)
    shape = GPTShape(layers, h, a, 128)
    acts = gpt_activation_bytes(shape, b, s, "fp32", checkpointing=True)
    block_input = 4 * b * s * h
    assert measured == layers * block_input  # what stays saved between forward and backward
    # backward in the last block: the other inputs, and that block's activations recomputed around its input
    assert acts.blocks == measured - block_input + gpt_block_activation_bytes(shape, b, s, 4)


def test_checkpointing_shrinks_activations_and_mixed_precision_halves_blocks():
    shape = GPTShape(n_layer=24, n_embd=2048, n_head=16, vocab_size=50304)
    full = gpt_activation_bytes(shape, 4, 1024, "bf16", checkpointing=False)
    ckpt = gpt_activation_bytes(shape, 4, 1024, "bf16", checkpointing=True)
    fp32 = gpt_activation_bytes(shape, 4, 1024, "fp32", checkpointing=False)
    assert ckpt.blocks < full.blocks / 5
    assert full.head == ckpt.head == gpt_head_activation_bytes(shape, 4, 1024, 2)
    assert abs(fp32.blocks / full.blocks - 2) < 0.01


def test_explicit_attention_grows_quadratically_with_sequence():
    shape = GPTShape(n_layer=1, n_embd=1024, n_head=16, vocab_size=1000, flash_attention=False)
    fused = GPTShape(n_layer=1, n_embd=1024, n_head=16, vocab_size=1000)
    assert gpt_block_activation_bytes(shape, 1, 8192, 2) > 3 * gpt_block_activation_bytes(fused, 1, 8192, 2)


def spec(**kw) -> EstimateInputs:
    base = dict(total_params=10_000_000, largest_layer_params=1_000_000, ranks_per_node=4, precision="fp16")
    base.update(kw)
    return EstimateInputs(**base)


def test_stage2_bucket_and_received_piece_are_capped_by_the_model_and_doubled_by_overlap():
    small = buffer_bytes(spec(zero_stage=2))  # default bucket 5e8 elements > 1e7 params
    assert small.reduce_bucket == (10_000_000 + 10_000_000 // 4) * 2
    # one bucket holds the whole model: nothing else can be in flight, overlap or not
    overlapped = buffer_bytes(spec(zero_stage=2, buffers=BufferSettings(overlap_comm=True)))
    assert overlapped.reduce_bucket == small.reduce_bucket
    tiny_bucket = buffer_bytes(spec(zero_stage=2, buffers=BufferSettings(reduce_bucket_size=1000)))
    assert tiny_bucket.reduce_bucket == (1000 + 250) * 2
    tiny_overlapped = buffer_bytes(spec(zero_stage=2, buffers=BufferSettings(reduce_bucket_size=1000,
                                                                            overlap_comm=True)))
    assert tiny_overlapped.reduce_bucket == 2 * tiny_bucket.reduce_bucket  # a second bucket in flight


@pytest.mark.parametrize("precision, ranks, engine_bytes", [
    ("fp32", 1, 3_764_224), ("fp32", 2, 2_823_168), ("bf16", 1, 1_882_112), ("bf16", 2, 1_411_584)])
def test_stage2_buffers_match_the_engines_pool(precision, ranks, engine_bytes):
    # Oracle: the engine's pooled stage-2 buffers (memory_breakdown().buffers) for a 470,528-parameter GPT.
    s = EstimateInputs(total_params=470_528, largest_layer_params=65_536, ranks_per_node=ranks, zero_stage=2,
                       precision=precision)
    assert buffer_bytes(s).reduce_bucket == engine_bytes


def test_stages_0_and_1_reduce_in_place():
    for stage in (0, 1):
        assert buffer_bytes(spec(zero_stage=stage)).backward == 0


def test_one_rank_at_stage3_gathers_nothing():
    assert buffer_bytes(spec(zero_stage=3, ranks_per_node=1)).backward == 0


def test_stage3_without_prefetch_gathers_deepspeeds_largest_layer_memory():
    # DeepSpeed: largest_layer_memory = 4 * largest_layer_params (fp16 params + fp16 grads).
    buffers = buffer_bytes(spec(zero_stage=3, buffers=BufferSettings(stage3_prefetch_bucket_size=0,
                                                                     reduce_bucket_size=0)))
    assert buffers.gathered_params == 4 * 1_000_000


def test_stage3_prefetch_is_capped_by_max_live_parameters_and_the_model():
    capped = buffer_bytes(spec(zero_stage=3, buffers=BufferSettings(stage3_max_live_parameters=3_000_000)))
    assert capped.gathered_params == (3_000_000 + 1_000_000) * 2
    whole = buffer_bytes(spec(zero_stage=3))  # default prefetch 5e7 > the 1e7-parameter model
    assert whole.gathered_params == (10_000_000 + 1_000_000) * 2



def test_stage3_reduction_is_transient_and_after_the_activations_when_one_bucket_holds_the_model():
    one_bucket = buffer_bytes(spec(zero_stage=3))  # 1e7 params < 5e8 bucket; overlap keeps all shards
    assert one_bucket.reduce_transient == (2 * 10_000_000 + 10_000_000 // 4) * 2
    assert not one_bucket.transient_during_backward
    assert one_bucket.backward == one_bucket.gathered_params
    # each module's gathered parameters were released after its gradient: only the reduction is left
    assert one_bucket.end_of_backward == one_bucket.reduce_transient
    many = buffer_bytes(spec(zero_stage=3, buffers=BufferSettings(reduce_bucket_size=1_000_000,
                                                                  overlap_comm=False)))
    assert many.reduce_transient == (2 * 1_000_000 + 250_000) * 2 and many.transient_during_backward
    # with buckets launched during backward, the gathered parameters are live with them; at the end only
    # the last buckets are
    assert many.backward == many.end_of_backward + many.gathered_params
