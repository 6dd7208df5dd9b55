"""DeepSpeed's inference v2 (FastGen) parts dsrun runs on a CPU (``dsrun/inference/v2``, served as
``deepspeed.inference.v2``): the KV-cache block allocator, the configs, the parameter containers and their
mapping, the tensor-parallel sharding, FP6 quantization and its linear, the gated activation, EXAONE 4.5's logic,
and the one-line refusal of what is CUDA-only.

No ``from __future__ import annotations``: DeepSpeed's containers read their annotations as classes."""

import importlib
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from dsrun.alias.paths import target_of
from dsrun.inference.v2 import RaggedInferenceEngineConfig, build_hf_engine
from dsrun.inference.v2.inference_parameter import InferenceParameter
from dsrun.inference.v2.inference_utils import ActivationType, DtypeEnum
from dsrun.inference.v2.kernels import NotOnCPUError, fp6
from dsrun.inference.v2.kernels.core_ops import CUDAGatedActivation
from dsrun.inference.v2.kernels.cutlass_ops import MixedGEMM
from dsrun.inference.v2.model_implementations import LayerContainer, ParameterBase, ParamList
from dsrun.inference.v2.model_implementations.common_parameters import UnfusedMoEMLP1Parameter
from dsrun.inference.v2.model_implementations.exaone.model import (Exaone4_5InferenceModel,
                                                                   _llama3_inverse_frequencies,
                                                                   _supported_sequence_length)
from dsrun.inference.v2.model_implementations.sharding import (attn_out_in_features, get_local_heads,
                                                               get_shard_endpoints, qkv_out_features,
                                                               shard_attn_out_param, shard_qkv_param)
from dsrun.inference.v2.modules import ConfigBundle
from dsrun.inference.v2.modules.configs import DSLinearConfig
from dsrun.inference.v2.modules.implementations.linear.quantized_linear import fp_quantize
from dsrun.inference.v2.modules.interfaces import DSLinearRegistry
from dsrun.inference.v2.ragged import BlockedAllocator, DSStateManagerConfig, PlaceholderSequenceDescriptor


def test_blocked_allocator_hands_out_each_block_once_and_refuses_bad_frees_atomically():
    allocator = BlockedAllocator(8)
    first, second = allocator.allocate(3), allocator.allocate(5)
    assert sorted(torch.cat([first, second]).tolist()) == list(range(8)) and allocator.free_blocks == 0
    with pytest.raises(ValueError, match="Not enough free blocks"):
        allocator.allocate(1)
    allocator.free(first)
    with pytest.raises(ValueError, match="already free"):  # block 0 is free: nothing of the list is freed
        allocator.free(torch.tensor([second[0].item(), first[0].item()]))
    with pytest.raises(ValueError, match="Invalid block 8"):
        allocator.free(8)
    assert allocator.free_blocks == 3
    assert sorted(allocator.allocate(3).tolist()) == sorted(first.tolist())  # the freed blocks come back
    allocator, rng, held = BlockedAllocator(8), random.Random(0), []
    for _ in range(300):  # random traffic never hands out a held block
        if held and (rng.random() < 0.5 or allocator.free_blocks == 0):
            allocator.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(allocator.allocate(rng.randint(1, allocator.free_blocks)))
        owned = torch.cat(held).tolist() if held else []
        assert len(set(owned)) == len(owned) == 8 - allocator.free_blocks


def test_state_manager_and_engine_configs_validate_as_deepspeeds():
    with pytest.raises(ValidationError):
        DSStateManagerConfig(max_ragged_batch_size=0)
    with pytest.raises(ValidationError, match="max_tracked_sequences"):
        DSStateManagerConfig(max_tracked_sequences=512, max_ragged_sequence_count=1024)
    config = RaggedInferenceEngineConfig(tp={"tp_size": 2}, manager={"max_ragged_batch_size": 1024},
                                         quantization={"quantization_mode": "wf6af16"})
    assert config.tensor_parallel.tp_size == 2 and config.state_manager.max_ragged_batch_size == 1024
    with pytest.raises(ValidationError, match="wf6af16"):  # DeepSpeed silently falls back to its CUDA linear
        RaggedInferenceEngineConfig(quantization={"quantization_mode": "int4"})
    with pytest.raises(ValidationError):
        RaggedInferenceEngineConfig(stat_manager={})


class _Pair(ParameterBase):
    first: torch.Tensor
    second: torch.Tensor

    def finalize(self) -> torch.Tensor:
        return InferenceParameter.initialize(torch.cat([self.first, self.second]))


_Items = ParamList("n_items")  # as many tensors as the inference model's ``n_items``


class _Stack(ParameterBase):
    items: _Items

    def finalize(self) -> torch.Tensor:
        return InferenceParameter.initialize(torch.stack(list(self.items)))


class _Layer(LayerContainer):
    PARAM_MAPPING = {"attn.a": "pair.first", "attn.b": "pair.second", "experts.*.w": "stack.items"}
    pair: _Pair
    stack: _Stack


def test_layer_container_finalizes_each_parameter_when_its_checkpoint_tensors_arrive():
    layer = _Layer(SimpleNamespace(n_items=3))
    layer.set_dependency("attn.b", torch.tensor([2.0]))
    assert isinstance(layer.pair, _Pair) and not layer.is_populated
    layer.set_dependency("attn.a", torch.tensor([1.0]))
    assert layer.pair.tolist() == [1.0, 2.0]
    for index in (2, 0, 1):  # list items by the wildcard's index, in any order
        layer.set_dependency(f"experts.{index}.w", torch.full((2, ), float(index)))
    assert layer.stack.tolist() == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    assert layer.is_populated and layer.is_initialized  # on the accelerator's device (the CPU here)
    with pytest.raises(ValueError, match="Could not find a mapping"):
        layer.set_dependency("mlp.w", torch.ones(1))


def test_layer_mapping_mistakes_are_refused_when_the_class_is_made():
    with pytest.raises(ValueError, match="not mapped: {'pair.second'}"):
        type("Missing", (LayerContainer, ), {"__annotations__": {"pair": _Pair}, "PARAM_MAPPING": {"a": "pair.first"}})
    with pytest.raises(ValueError, match="Target parameter \"other\" not found"):
        type("Unknown", (LayerContainer, ), {"__annotations__": {"pair": _Pair},
                                             "PARAM_MAPPING": {"a": "pair.first", "b": "other.second"}})
    with pytest.raises(ValueError, match="multiple mapping rules"):
        type("Twice", (LayerContainer, ), {"__annotations__": {"pair": _Pair},
                                           "PARAM_MAPPING": {"a": "pair.first", "b": ["pair.second", "pair.first"]}})


def test_moe_experts_are_stacked_in_expert_order_for_the_models_transform():
    seen = []
    model = SimpleNamespace(n_experts=2, transform_moe_mlp_1_param=lambda p: seen.append(p) or
                            InferenceParameter.initialize(p))
    layer = type("MoE", (LayerContainer, ), {"__annotations__": {"moe": UnfusedMoEMLP1Parameter}})(model)
    layer.moe.experts[1] = torch.ones(2, 2)
    assert not layer.is_initialized
    layer.moe.experts[0] = torch.zeros(2, 2)
    assert layer.is_initialized and seen[0].shape == (2, 2, 2) and seen[0][1].eq(1).all() and seen[0][0].eq(0).all()


def _head_ids(head_size: int, n_heads: int, first_id: int = 0) -> torch.Tensor:
    return torch.arange(first_id, first_id + n_heads).repeat_interleave(head_size).float().unsqueeze(1).expand(-1, 3)


@pytest.mark.parametrize("n_heads_q, n_heads_kv, n_shards", [(8, 8, 3), (8, 4, 2), (8, 2, 4), (12, 2, 4)])
def test_qkv_sharding_keeps_whole_heads_and_each_q_head_with_its_kv_head(n_heads_q, n_heads_kv, n_shards):
    head = 4
    param = torch.cat([_head_ids(head, n_heads_q), _head_ids(head, n_heads_kv, 100), _head_ids(head, n_heads_kv, 200)])
    q_heads_seen = []
    for rank in range(n_shards):
        shard = shard_qkv_param(param, rank, n_shards, head, n_heads_q, n_heads_kv)
        local_q, local_kv = get_local_heads(rank, n_shards, n_heads_q, n_heads_kv)
        assert shard.shape[0] == (local_q + 2 * local_kv) * head == qkv_out_features(
            n_heads_q * head, rank, n_shards, head, n_heads_q, n_heads_kv)
        ids = shard[::head, 0].long().tolist()
        q_ids, k_ids, v_ids = ids[:local_q], ids[local_q:local_q + local_kv], ids[local_q + local_kv:]
        assert [k - 100 for k in k_ids] == [v - 200 for v in v_ids]
        group = n_heads_q // n_heads_kv  # q head i belongs to kv head i // group
        assert all(q // group + 100 in k_ids for q in q_ids)
        q_heads_seen += q_ids
        out = shard_attn_out_param(param[:n_heads_q * head].t().contiguous(), rank, n_shards, head, n_heads_q,
                                   n_heads_kv)
        assert out.shape[1] == attn_out_in_features(n_heads_q * head, rank, n_shards, head, n_heads_q, n_heads_kv)
        assert out[0, ::head].long().tolist() == q_ids  # the output projection's columns of the same q heads
    assert sorted(q_heads_seen) == list(range(n_heads_q))  # every q head on exactly one rank


def test_shard_endpoints_give_the_first_ranks_the_extra_grains_and_bad_shapes_are_refused():
    assert [get_shard_endpoints(5 * 32, rank, 3) for rank in range(3)] == [(0, 64), (64, 128), (128, 160)]
    with pytest.raises(ValueError, match="GQA param shape"):
        shard_qkv_param(torch.empty(2048, 8), 0, 1, 64, 16, 4)
    with pytest.raises(ValueError, match="distributing KV heads"):
        shard_qkv_param(torch.empty((8 + 2 * 2) * 8, 8), 0, 3, 8, 8, 2)  # 2 kv heads over 3 ranks


def test_fp6_grid_is_e3m2_with_largest_28_and_rounds_to_nearest_ties_to_even():
    grid = fp6.MAGNITUDES
    assert grid.numel() == 32 and grid[-1] == 28 and grid[1] == 2**-4 and (grid[1:] > grid[:-1]).all()
    assert torch.equal(fp6.decode(fp6.encode(fp6.VALUES)), fp6.VALUES)  # grid values are exact
    x = torch.linspace(-30, 30, 20001)
    q = fp6.decode(fp6.encode(x))
    gaps = torch.cat([grid[1:] - grid[:-1], grid[-1:] - grid[-2:-1]])
    half_gap = gaps[torch.bucketize(q.abs(), grid).clamp(max=31)] / 2  # |x - q| <= half the gap at q (or the clip)
    assert ((x - q).abs() <= torch.maximum(half_gap, (x.abs() - 28).clamp(min=0)) + 1e-6).all()
    ties = torch.tensor([0.03125, 0.09375, 1.125, 13.0, 15.0])  # midpoints: to the even code
    assert fp6.decode(fp6.encode(ties)).tolist() == [0.0, 0.125, 1.0, 12.0, 16.0]
    codes = fp6.encode(torch.randn(16, 5) * 8)
    two_bit, four_bit = fp6.split_2_4(codes)
    assert two_bit.numel() + four_bit.numel() == codes.numel() * 6 // 8 and torch.equal(fp6.join_2_4(two_bit, four_bit),
                                                                                       codes)


@pytest.mark.parametrize("act_fn", [ActivationType.GELU, ActivationType.SiGLU])
def test_fp6_quantized_linear_matches_a_linear_over_the_dequantized_weight(act_fn):
    torch.manual_seed(0)
    tokens, in_ch, out_ch = 5, 64, 256
    gated = act_fn == ActivationType.SiGLU
    weight = (torch.randn(out_ch * (2 if gated else 1), in_ch) * 0.02).half()
    quantized, scales = fp_quantize(weight)
    assert scales.shape == (weight.shape[0], 1)
    # each row's largest magnitude maps to 28; rounding moves a weight at most half an FP6 step (1/8 relative
    # above 0.25, 2**-5 absolute below), times the scale, plus fp16's rounding of the scale itself
    step = torch.where(weight.float().abs() / scales.float() >= 0.25, weight.float().abs() / 8, 2.0**-5 * scales.float())
    assert ((quantized.float() * scales.float() - weight.float()).abs() <= step + weight.float().abs() * 2**-10).all()
    config = DSLinearConfig(max_tokens=16, in_channels=in_ch, out_channels=out_ch, activation=act_fn)
    linear = DSLinearRegistry.instantiate_config(ConfigBundle(name="quantized_wf6af16_linear", config=config))
    w, bias = linear.transform_param(weight), (torch.randn(weight.shape[0]) * 0.01).half()
    assert w.numel() + w.weights_4bit.numel() == weight.numel() * 6 // 8  # 6 bits a weight
    hidden = torch.randn(tokens, in_ch).half()
    out = linear(hidden, w, bias)
    reference = F.linear(hidden.float(), quantized.float() * scales.float()) + bias.float()
    if gated:
        reference = F.silu(reference[:, ::2]) * reference[:, 1::2]
    else:
        reference = F.gelu(reference)
    # the only roundings after float32 arithmetic: fp16 storage of the staging buffer and of the output
    torch.testing.assert_close(out.float(), reference, rtol=2**-9, atol=1e-5)
    wrong = DSLinearRegistry.instantiate_config(ConfigBundle(name="quantized_wf6af16_linear", config=DSLinearConfig(
        max_tokens=16, in_channels=72, out_channels=256)))
    with pytest.raises(ValueError, match="multiple of 256 and 64"):
        wrong(torch.zeros(1, 72).half(), wrong.transform_param(torch.ones(256, 72).half()))


def test_gated_activation_computes_deepspeeds_reference_and_validates_like_its_kernel():
    x, bias = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    out = torch.empty(3, 8, dtype=torch.bfloat16)
    CUDAGatedActivation(16, torch.bfloat16, ActivationType.GEGLU)(out, x, bias)
    y = x.float() + bias.float()
    expected = F.gelu(y[:, ::2], approximate="tanh") * y[:, 1::2]
    assert torch.equal(out, expected.to(torch.bfloat16))
    for args, message in [((128, torch.int8, ActivationType.GEGLU), "Unsupported data type"),
                          ((128, torch.float16, ActivationType.RELU), "Unsupported activation"),
                          ((127, torch.float16, ActivationType.GEGLU), "16 bytes"),
                          ((49160, torch.float16, ActivationType.GEGLU), "98304 bytes")]:
        with pytest.raises(ValueError, match=message):
            CUDAGatedActivation(*args)


def _exaone_config(**changes) -> SimpleNamespace:
    rope = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 1e6}
    return SimpleNamespace(**{"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "num_hidden_layers": 2, "max_position_embeddings": 65536, "sliding_window": 4096,
                              "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": rope,
                              "torch_dtype": torch.bfloat16, **changes})


def test_exaone4_5_llama3_frequencies_keep_short_waves_divide_long_ones_and_blend_between():
    inv = _llama3_inverse_frequencies(_exaone_config(), "cpu")
    base = 1.0 / 1e6**(torch.arange(0, 128, 2).double() / 128)
    wavelength = 2 * math.pi / base
    short, long_ = wavelength < 8192 / 4, wavelength > 8192
    assert inv.dtype == torch.float32 and inv.shape == (64, )
    torch.testing.assert_close(inv[short].double(), base[short], rtol=1e-6, atol=0)
    torch.testing.assert_close(inv[long_].double(), base[long_] / 16, rtol=1e-6, atol=0)
    middle = ~short & ~long_
    smooth = (8192 / wavelength[middle] - 1) / 3
    torch.testing.assert_close(inv[middle].double(), (1 - smooth) * base[middle] / 16 + smooth * base[middle],
                               rtol=1e-5, atol=0)


def test_exaone4_5_caps_sequences_at_the_window_and_schedules_kv_blocks_within_it():
    config = _exaone_config()
    assert _supported_sequence_length(config) == 4096
    assert _supported_sequence_length(_exaone_config(layer_types=["full_attention"] * 2)) == 65536
    model = Exaone4_5InferenceModel.__new__(Exaone4_5InferenceModel)
    torch.nn.Module.__init__(model)
    model._config, model.attn = config, SimpleNamespace(kv_block_size=64)
    assert model.get_kv_requirements(PlaceholderSequenceDescriptor(4000, 63), 128, 10) == (96, 1)
    assert model.get_kv_requirements(PlaceholderSequenceDescriptor(0, 0), 1000, 4) == (256, 4)  # block-limited
    assert model.activation_dtype == DtypeEnum.bf16
    with pytest.raises(NotOnCPUError, match="Exaone4_5InferenceModel: its layers include DeepSpeed.s embedding"):
        Exaone4_5InferenceModel(config, RaggedInferenceEngineConfig(), None)


def test_cuda_only_names_are_refused_with_one_line_and_deepspeed_paths_reach_dsruns_modules():
    with pytest.raises(NotOnCPUError, match=r"^deepspeed\.inference\.v2\.kernels\.cutlass_ops\.MixedGEMM: a CUTLASS"):
        MixedGEMM(DtypeEnum.fp16, ActivationType.GELU, 4)
    with pytest.raises(NotOnCPUError, match="build_hf_engine"):
        build_hf_engine("any/model", RaggedInferenceEngineConfig())
    for path, name in [("deepspeed.inference.v2.model_implementations.exaone4_5.model", "Exaone4_5InferenceModel"),
                       ("deepspeed.inference.v2.model_implementations.exaone4.model", "Exaone4InferenceModel"),
                       ("deepspeed.inference.v2.modules.module_registry", "ConfigBundle"),
                       ("deepspeed.inference.v2.ragged.blocked_allocator", "BlockedAllocator"),
                       ("deepspeed.inference.v2.model_implementations.sharding", "shard_qkv_param"),
                       ("deepspeed.inference.v2.kernels.ragged_ops", "BlockedFlashAttn"),
                       ("deepspeed.inference.v2.model_implementations.flat_model_helpers", "flatten_inference_model"),
                       ("deepspeed.inference.v2.modules.implementations", "cuda_post_ln"),
                       ("deepspeed.ops.op_builder", "RaggedUtilsBuilder")]:
        assert hasattr(importlib.import_module(target_of(path)), name), path


def test_megatron_qkv_layouts_are_reordered_to_all_q_then_all_k_then_all_v():
    from dsrun.inference.v2.model_implementations.common_parameters import (megatron_qkv_reshape,
                                                                            transform_gqa_megatron)
    rows = torch.arange(12.0).view(12, 1)  # 2 heads of 2 rows: q0 k0 v0 q1 k1 v1
    assert megatron_qkv_reshape(rows, 2, 2).flatten().tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    grouped = torch.arange(8.0).view(8, 1)  # 1 kv group, 2 q heads of 2 rows: q0 q1 k v
    assert transform_gqa_megatron(grouped, 2, 2, 1).tolist() == list(range(8))


def test_inference_parameter_aux_tensors_follow_device_moves_but_not_dtype_casts():
    weight = InferenceParameter.initialize(torch.ones(4, 2), scales=torch.ones(4))
    with pytest.raises(ValueError, match="already exists"):
        InferenceParameter.initialize(torch.ones(1), shape=torch.ones(1))
    moved = weight.to("meta")
    assert moved.device.type == "meta" and moved.scales.device.type == "meta" and moved.aux_attrs["scales"] is moved.scales
    cast = weight.to(torch.float16)
    assert cast.dtype == torch.float16 and cast.scales.dtype == torch.float32


# --- the ragged batch, the state manager and the torch kernels (DeepSpeed's CUDA ones) ---------------------------

def _manager_and_batch(seq_params, head_size=64, n_kv=1, block_size=4, blocks=16, padding=False):
    """A state manager whose cache is filled with a sentinel, and a batch of sequences (tokens, seen before): each
    sequence has seen its history (post_forward) and holds the blocks it needs, taken out of order."""
    from dsrun.inference.v2.ragged import (AllocationMode, DSStateManager, KVCacheConfig, MemoryConfig,
                                           RaggedBatchWrapper)
    config = DSStateManagerConfig(max_tracked_sequences=8, max_ragged_sequence_count=8, max_ragged_batch_size=128,
                                  memory_config=MemoryConfig(mode=AllocationMode.ALLOCATE, size=blocks))
    kv_config = KVCacheConfig(block_size=block_size, cache_shape=(1, n_kv, head_size), cache_dtype=torch.float16)
    manager = DSStateManager(config, (kv_config, ))
    manager.get_cache(0).fill_(-7.0)
    manager.allocate_blocks(1)  # so a sequence's blocks are not 0, 1, 2, ...
    batch = RaggedBatchWrapper(config)
    descs = []
    for uid, (n_tokens, seen) in enumerate(seq_params):
        desc = manager.get_or_create_sequence(uid)
        desc.pre_forward(seen)
        desc.post_forward()
        desc.extend_kv_cache(manager.allocate_blocks(-(-(n_tokens + seen) // block_size)))
        batch.insert_sequence(desc, torch.arange(n_tokens) + 100 * uid)
        desc.pre_forward(n_tokens)
        descs.append(desc)
    batch.finalize(padding=padding)
    return manager, batch, descs


def test_ragged_batch_holds_deepspeeds_metadata_and_the_state_manager_tracks_blocks():
    from dsrun.inference.v2.ragged.sequence_descriptor import block_ids_at
    manager, batch, descs = _manager_and_batch([(3, 0), (1, 5), (2, 2)], padding=True)
    assert (batch.current_tokens, batch.current_sequences, batch.tensor_toks) == (6, 3, 64)
    assert batch.input_ids()[:6].tolist() == [0, 1, 2, 100, 200, 201] and set(batch.input_ids()[6:].tolist()) == {-1}
    assert batch.tokens_to_seq()[:6].tolist() == [0, 0, 0, 1, 2, 2] and batch.batch_metadata_buffer().tolist() == [6, 3]
    assert batch.inflight_seq_descriptors().tolist() == [[0, 3, 0, 0], [3, 1, 5, 0], [4, 2, 2, 0]]
    for ptr, desc in zip(batch.kv_ptrs().tolist(), descs):  # each address reads back the sequence's blocks
        assert torch.equal(block_ids_at(ptr)[0, :desc.cur_allocated_blocks], desc.all_block_ids())
    assert [d.cur_allocated_blocks for d in descs] == [1, 2, 1] and manager.free_blocks == [16 - 1 - 4]
    with pytest.raises(ValueError, match="not a tracked sequence's block table"):
        block_ids_at(12345)
    with pytest.raises(RuntimeError, match="capacity limit"):
        batch.insert_sequence(PlaceholderSequenceDescriptor(), torch.zeros(200, dtype=torch.int64))
    manager.flush_sequence(1)
    assert manager.free_blocks == [16 - 1 - 2] and manager.get_sequence(1) is None
    batch.clear()
    assert (batch.current_tokens, batch.current_sequences) == (0, 0)


def _rotate_half_reference(x, positions, inv_freq):
    """Plain rotate-half RoPE in float64: x [tokens, heads, head] rotated by positions * inv_freq."""
    angles = positions.double().view(-1, 1, 1) * inv_freq.double().view(1, 1, -1)
    cos, sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([angles.sin(), angles.sin()], -1)
    half = x.shape[-1] // 2
    return x.double() * cos + torch.cat([-x[..., half:], x[..., :half]], -1).double() * sin


@pytest.mark.parametrize("trained", [False, True])
def test_kv_copy_rotates_queries_and_keys_and_writes_each_token_to_its_block(trained):
    from dsrun.inference.v2.kernels.ragged_ops import (BlockedRotaryEmbeddings, BlockedTrainedRotaryEmbeddings,
                                                       LinearBlockedKVCopy)
    head, n_q, n_kv = 64, 2, 1  # a GQA group of two query heads
    manager, batch, descs = _manager_and_batch([(5, 0), (2, 6)], head_size=head, n_kv=n_kv)
    kv_cache = manager.get_cache(0)
    qkv = torch.randn(7, (n_q + 2 * n_kv) * head, generator=torch.Generator().manual_seed(3)).half()
    original = qkv.clone()
    positions = torch.tensor([0, 1, 2, 3, 4, 6, 7])
    inv_freq = 1.0 / 10000.0**(torch.arange(0, head, 2, dtype=torch.float32) / head)
    if trained:
        inv_freq = inv_freq * 1.5
        BlockedTrainedRotaryEmbeddings(head, n_q, n_kv, torch.float16)(kv_cache, qkv, batch, inv_freq)
        q_freq, k_freq = [inv_freq, inv_freq], inv_freq
    else:
        BlockedRotaryEmbeddings(head, n_q, n_kv, torch.float16, head, 10000.0)(kv_cache, qkv, batch)
        rounded = inv_freq.half().float()  # DeepSpeed's kernel: keys and each group's first query head
        q_freq, k_freq = [rounded, inv_freq], rounded
    q = original[:, :n_q * head].view(7, n_q, head)
    for h in range(n_q):
        expect = _rotate_half_reference(q[:, h:h + 1], positions, q_freq[h]).half()
        # float32 math rounded to fp16: at most one fp16 step (2**-10 relative) from the float64 reference
        torch.testing.assert_close(qkv[:, h * head:(h + 1) * head], expect.view(7, head), rtol=2**-10, atol=1e-3)
    k_expect = _rotate_half_reference(original[:, n_q * head:(n_q + 1) * head].view(7, 1, head), positions, k_freq)
    tables = [d.all_block_ids().tolist() for d in descs]
    slots = [(tables[0][p // 4], p % 4) for p in range(5)] + [(tables[1][p // 4], p % 4) for p in (6, 7)]
    for t, (block, row) in enumerate(slots):
        torch.testing.assert_close(kv_cache[block, row, 0], k_expect[t].half(), rtol=2**-10, atol=1e-3)
        assert torch.equal(kv_cache[block, row, 1, 0], original[t, (n_q + 1) * head:])
    written = {slot for slot in slots}
    untouched = [(b, r) for b in range(16) for r in range(4) if (b, r) not in written]
    assert all(bool((kv_cache[b, r] == -7.0).all()) for b, r in untouched)
    with pytest.raises(ValueError, match="Unsupported head size"):
        LinearBlockedKVCopy(48, 2, 1, torch.float16)


def test_blocked_attention_is_causal_attention_over_each_sequences_cached_history():
    from dsrun.inference.v2.modules.configs import DSSelfAttentionConfig
    from dsrun.inference.v2.modules.interfaces import DSSelfAttentionRegistry
    from dsrun.inference.v2.kernels.ragged_ops import LinearBlockedKVCopy
    from dsrun.inference.v2.ragged import RaggedBatchWrapper
    head, n_q, n_kv = 64, 4, 2
    gen = torch.Generator().manual_seed(5)
    # first pass: two prompts fill the cache; second pass: a 3-token continuation of each
    config = DSSelfAttentionConfig(max_tokens=64, n_heads_q=n_q, n_heads_kv=n_kv, head_size=head, max_sequences=8,
                                   scale_factor=0.125)
    attn = DSSelfAttentionRegistry.instantiate_config(ConfigBundle(name="dense_blocked_attention", config=config))
    block = attn.kv_block_size  # the cache's block size is the attention's choice (128 for 64-channel heads)
    manager, batch, descs = _manager_and_batch([(6, 0), (3, 0)], head_size=head, n_kv=n_kv, block_size=block,
                                               blocks=6)
    first = torch.randn(9, (n_q + 2 * n_kv) * head, generator=gen).half()
    LinearBlockedKVCopy(head, n_q, n_kv, torch.float16)(manager.get_cache(0), first, batch)
    second_batch = RaggedBatchWrapper(DSStateManagerConfig(max_ragged_sequence_count=8, max_ragged_batch_size=64))
    for uid, desc in enumerate(descs):
        desc.post_forward()
        second_batch.insert_sequence(desc, torch.zeros(3, dtype=torch.int64))
        desc.pre_forward(3)
    second_batch.finalize()
    second = torch.randn(6, (n_q + 2 * n_kv) * head, generator=gen).half()
    attn.build_atoms(second_batch)
    out = attn(second.clone(), manager.get_cache(0), second_batch)
    for rows_old, rows_new in ((slice(0, 6), slice(0, 3)), (slice(6, 9), slice(3, 6))):
        kv = torch.cat([first[rows_old, n_q * head:], second[rows_new, n_q * head:]]).double()
        k = kv[:, :n_kv * head].view(-1, n_kv, head).repeat_interleave(n_q // n_kv, 1).transpose(0, 1)
        v = kv[:, n_kv * head:].view(-1, n_kv, head).repeat_interleave(n_q // n_kv, 1).transpose(0, 1)
        q = second[rows_new, :n_q * head].double().view(3, n_q, head).transpose(0, 1)
        seen = k.shape[1] - 3
        mask = torch.arange(k.shape[1]).view(1, -1) <= (seen + torch.arange(3)).view(-1, 1)
        expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125).transpose(0, 1).reshape(3, -1)
        torch.testing.assert_close(out[rows_new], expect.half(), rtol=2**-10, atol=1e-3)


def test_ragged_embedding_adds_positions_and_logits_gather_takes_each_sequences_last_token():
    from dsrun.inference.v2.kernels.ragged_ops import RaggedEmbeddingKernel, RaggedLogitsGather
    _, batch, _ = _manager_and_batch([(3, 0), (2, 4)], padding=True)
    vocab = torch.randn(300, 8)
    positions_table = torch.randn(16, 8)
    out = torch.full((batch.tensor_toks, 8), 9.0)
    RaggedEmbeddingKernel(torch.float32, torch.int64, 8)(out, batch, vocab, positions_table, 2)
    ids, positions = torch.tensor([0, 1, 2, 100, 101]), torch.tensor([0, 1, 2, 4, 5])
    assert torch.equal(out[:5], vocab[ids] + positions_table[positions + 2])
    assert bool((out[5:] == 9.0).all())  # padding rows are left alone
    last = torch.empty(2, 8)
    RaggedLogitsGather(8, torch.float32)(last, out, batch)
    assert torch.equal(last, out[[2, 4]])
    with pytest.raises(ValueError, match="aligned to 16 bytes"):
        RaggedEmbeddingKernel(torch.float16, torch.int32, 4)


def test_moe_module_routes_each_token_through_its_top_k_experts():
    from dsrun.inference.v2.kernels.ragged_ops import RaggedTopKGating
    from dsrun.inference.v2.modules.configs import DSMoEConfig
    from dsrun.inference.v2.modules.interfaces import DSMoERegistry
    tokens, dim, hidden, experts, k = 5, 16, 8, 4, 2
    _, batch, _ = _manager_and_batch([(tokens, 0)])
    gen = torch.Generator().manual_seed(11)
    x, gate = torch.randn(tokens, dim, generator=gen).half(), torch.randn(experts, dim, generator=gen).half()
    w1, w2 = torch.randn(experts, hidden, dim, generator=gen).half(), torch.randn(experts, dim, hidden, generator=gen).half()
    config = DSMoEConfig(max_tokens=32, model_dim=dim, intermediate_features=hidden, n_experts=experts, top_k=k,
                         activation=ActivationType.RELU, normalize_scores=True)
    moe = DSMoERegistry.instantiate_config(ConfigBundle(name="cutlass_multi_gemm_moe", config=config,
                                                        implementation_config={"weight_dtype": DtypeEnum.fp16}))
    out = moe(x, batch, moe.transform_gate_param(gate), moe.transform_moe_mlp_1_param(w1),
              moe.transform_moe_mlp_2_param(w2))
    logits = (x.float() @ gate.float().t()).half().float()
    scores, chosen = logits.softmax(-1).topk(k, dim=-1)
    scores = scores / scores.sum(-1, keepdim=True)
    for t in range(tokens):
        mid = [F.relu((x[t].float() @ w1[e].float().t()).half().float()).half().float() for e in chosen[t].tolist()]
        expect = sum(s * (m @ w2[e].float().t()).half().float() for s, m, e in zip(scores[t], mid, chosen[t].tolist()))
        torch.testing.assert_close(out[t].float(), expect, rtol=2**-9, atol=2e-3)
    # ties go to the lower expert; each expert's tokens get slots 0, 1, ... in order; padding is unassigned
    counts, scores_out = torch.zeros(4, dtype=torch.int32), torch.empty(3, 1)
    assignments, offsets = torch.empty(3, 1, dtype=torch.int32), torch.empty(3, 1, dtype=torch.int32)
    _, tie_batch, _ = _manager_and_batch([(2, 0)])
    RaggedTopKGating(DtypeEnum.fp16)(counts, scores_out, assignments, offsets,
                                     torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1], [5, 5, 5, 5]]).half(), tie_batch)
    assert assignments.flatten().tolist() == [1, 0, -1] and offsets.flatten().tolist() == [0, 0, -1]
    assert counts.tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize("name, norm", [("cuda_pre_ln", "layer_norm"), ("cuda_pre_rms", "rms_norm"),
                                        ("cuda_post_ln", "layer_norm")])
def test_norm_modules_add_the_residual_and_normalize(name, norm):
    from dsrun.inference.v2.modules.configs import DSNormConfig
    from dsrun.inference.v2.modules.interfaces import DSPostNormRegistry, DSPreNormRegistry
    config = DSNormConfig(max_tokens=16, type=norm, channels=8, residual_dtype=torch.float32,
                          input_dtype=torch.float32, output_dtype=torch.float32, eps=1e-5)
    registry = DSPostNormRegistry if name == "cuda_post_ln" else DSPreNormRegistry
    module = registry.instantiate_config(ConfigBundle(name=name, config=config))
    gen = torch.Generator().manual_seed(2)
    residual, hidden, gamma, beta = (torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen),
                                     torch.randn(8, generator=gen), torch.randn(8, generator=gen))
    total = residual + hidden
    if norm == "layer_norm":
        expect = F.layer_norm(total, (8, ), gamma, beta, 1e-5)
        res_out, hid_out = module(residual, hidden, module.transform_param(gamma), module.transform_param(beta))
    else:
        expect = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
        res_out, hid_out = module(residual, hidden, module.transform_param(gamma))
    assert torch.equal(res_out, expect if name == "cuda_post_ln" else total)
    torch.testing.assert_close(hid_out, expect, rtol=1e-6, atol=1e-6)  # float32 math both sides
    if name != "cuda_post_ln":  # no hidden states: the residual alone is normalized (CUDAFPLN, CUDARMSNorm)
        params = [module.transform_param(gamma)] + ([module.transform_param(beta)] if norm == "layer_norm" else [])
        alone_res, alone_hid = module(residual.clone(), None, *params)
        alone = (F.layer_norm(residual, (8, ), gamma, beta, 1e-5) if norm == "layer_norm" else
                 residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma)
        assert torch.equal(alone_res, residual)
        torch.testing.assert_close(alone_hid, alone, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not supported"):  # residual, input and output must share a dtype
        registry.instantiate_config(ConfigBundle(name=name, config=config.model_copy(update={"input_dtype":
                                                                                              torch.float16})))


def test_flat_model_helpers_round_trip_parameters_through_one_aligned_buffer():
    from dsrun.inference.v2.model_implementations.flat_model_helpers import (flatten_inference_model,
                                                                             restore_inference_model)

    class Weight(ParameterBase):
        param: torch.Tensor

        def finalize(self) -> torch.Tensor:
            return InferenceParameter.initialize(self.param, scales=torch.arange(3.0))

    class Layer(LayerContainer):
        PARAM_MAPPING = {"w": "w.param", "b": "b.param"}
        w: Weight
        b: Weight

    model = SimpleNamespace()
    layers = [Layer(model) for _ in range(2)]
    head = Layer(model)
    values = {}
    for i, layer in enumerate(layers + [head]):
        values[i] = (torch.randn(4, 6).t(), torch.randn(5).half())  # a transposed weight keeps its strides
        layer.set_dependency("w", values[i][0])
        layer.set_dependency("b", values[i][1])
    buffer, metadata = flatten_inference_model(layers, head, "TestPolicy")
    offsets = [p.core_param.offset for layer in metadata.layers.values() for p in layer.params.values()]
    assert all(o % 256 == 0 for o in offsets) and len(set(offsets)) == len(offsets)
    restored_layers, restored_head = [Layer(model) for _ in range(2)], Layer(model)
    restore_inference_model(buffer, metadata, restored_layers, restored_head)
    for i, layer in enumerate(restored_layers + [restored_head]):
        assert torch.equal(layer.w, values[i][0]) and layer.w.stride() == (1, 6) and torch.equal(layer.b, values[i][1])
        assert torch.equal(layer.w.scales, torch.arange(3.0))
        assert layer.w.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # views, no copy


def test_blas_fp_linear_is_the_default_linear_and_gates_its_doubled_output():
    from dsrun.inference.v2.modules.heuristics import instantiate_linear
    config = DSLinearConfig(max_tokens=16, in_channels=8, out_channels=8, activation=ActivationType.SiGLU)
    linear = instantiate_linear(config, RaggedInferenceEngineConfig())  # no quantization: DeepSpeed's blas_fp_linear
    assert linear.name() == "blas_fp_linear"
    gen = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(3, 8, generator=gen).half(), torch.randn(16, 8, generator=gen).half(),
               torch.randn(16, generator=gen).half())
    out = linear(x, linear.transform_param(w), linear.transform_param(b))
    staged = (x.float() @ w.float().t()).half().float() + b.float()  # the GEMM's fp16 output, then bias + gate
    expect = (F.silu(staged[:, ::2]) * staged[:, 1::2]).half()
    torch.testing.assert_close(out, expect, rtol=2**-10, atol=1e-3)
