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
from dsrun.inference.v2.kernels.core_ops import CUDAGatedActivation, CUDARMSNorm
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
    with pytest.raises(NotOnCPUError, match="Exaone4_5InferenceModel: its layers are DeepSpeed.s CUDA kernels"):
        Exaone4_5InferenceModel(config, RaggedInferenceEngineConfig(), None)


def test_cuda_only_names_are_refused_with_one_line_and_deepspeed_paths_reach_dsruns_modules():
    with pytest.raises(NotOnCPUError, match=r"^deepspeed\.inference\.v2\.kernels\.core_ops\.CUDARMSNorm: a CUDA kernel"):
        CUDARMSNorm(128, torch.float16)
    with pytest.raises(NotOnCPUError, match="build_hf_engine"):
        build_hf_engine("any/model", RaggedInferenceEngineConfig())
    for path, name in [("deepspeed.inference.v2.model_implementations.exaone4_5.model", "Exaone4_5InferenceModel"),
                       ("deepspeed.inference.v2.model_implementations.exaone4.model", "Exaone4InferenceModel"),
                       ("deepspeed.inference.v2.modules.module_registry", "ConfigBundle"),
                       ("deepspeed.inference.v2.ragged.blocked_allocator", "BlockedAllocator"),
                       ("deepspeed.inference.v2.model_implementations.sharding", "shard_qkv_param")]:
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
