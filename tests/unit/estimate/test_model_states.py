"""Model-state bytes per rank: the per-parameter rules for each stage, offload, precision and optimizer."""
from __future__ import annotations

import pytest

from dsrun.estimate.inputs import BufferSettings, EstimateInputs
from dsrun.estimate.model_states import init_bytes_per_rank, model_state_bytes, optimizer_state_count
from dsrun.utils.errors import ConfigError

P = 1_000_000_000  # divisible by every world size used here


def spec(**kw) -> EstimateInputs:
    base = dict(total_params=P, largest_layer_params=P // 100, ranks_per_node=8, precision="bf16",
                optimizer="AdamW")
    base.update(kw)
    return EstimateInputs(**base)


@pytest.mark.parametrize("name, params, states", [
    ("Adam", {}, 2), ("AdamW", {}, 2), ("adam_w", {}, 2), ("Lamb", {}, 2), ("OneBitAdam", {}, 2),
    ("ZeroOneAdam", {}, 3), ("OneBitLamb", {}, 3),
    ("Lion", {}, 1), ("Adagrad", {}, 1), ("SGD", {}, 0), ("SGD", {"momentum": 0.9}, 1),
    ("RMSprop", {}, 1), ("RMSprop", {"momentum": 0.9, "centered": True}, 3),
])
def test_optimizer_state_counts(name, params, states):
    assert optimizer_state_count(name, params) == states


def test_unknown_optimizer_names_the_key_and_suggests():
    with pytest.raises(ConfigError) as err:
        optimizer_state_count("Adamm")
    assert "ds.optimizer.type" in str(err.value) and "did you mean 'adam'" in str(err.value)


def test_stage0_mixed_precision_adam_is_20_bytes_per_parameter():
    # 2 (bf16 params) + 4 (fp32 master) + 2 (bf16 grads) + 4 (fp32 grads) + 8 (two fp32 Adam moments)
    assert model_state_bytes(spec(zero_stage=0)).device_total == 20 * P


def test_stage0_fp32_adam_is_16_bytes_per_parameter():
    assert model_state_bytes(spec(zero_stage=0, precision="fp32")).device_total == 16 * P


@pytest.mark.parametrize("stage, expected", [
    (1, 2 * P + 2 * P + (4 + 4 + 2 + 8) * P // 8),   # master, fp32 grads (+ received piece), states partitioned
    (2, 2 * P + (4 + 4 + 8) * P // 8),               # + only the fp32 gradient partition kept
    (3, (2 + 4 + 4 + 8) * P // 8),                   # + parameters partitioned
])
def test_each_stage_partitions_one_more_state(stage, expected):
    assert model_state_bytes(spec(zero_stage=stage)).device_total == expected


# Oracle: dsrun's engine (ZeroStrategy.memory_breakdown(), engine branch) after one AdamW step of a GPT with
# 470,528 parameters (all below the persistence threshold): total model-state bytes per rank.
ENGINE_P = 470_528
ENGINE_TOTALS = {
    ("fp32", 0, 1): 7_528_448, ("fp32", 0, 2): 7_528_448, ("fp32", 1, 1): 11_292_672, ("fp32", 1, 2): 7_528_448,
    ("fp32", 2, 1): 9_410_560, ("fp32", 2, 2): 5_646_336, ("fp32", 3, 1): 9_410_560, ("fp32", 3, 2): 5_646_336,
    ("bf16", 0, 1): 9_410_560, ("bf16", 0, 2): 9_410_560, ("bf16", 1, 1): 10_351_616, ("bf16", 1, 2): 6_116_864,
    ("bf16", 2, 1): 8_469_504, ("bf16", 2, 2): 4_705_280, ("bf16", 3, 1): 9_410_560, ("bf16", 3, 2): 5_175_808,
}


@pytest.mark.parametrize("precision, stage, ranks", sorted(ENGINE_TOTALS))
def test_model_states_match_the_engines_own_accounting(precision, stage, ranks):
    states = model_state_bytes(EstimateInputs(
        total_params=ENGINE_P, largest_layer_params=65_536, ranks_per_node=ranks, zero_stage=stage,
        precision=precision, optimizer="AdamW", small_params=ENGINE_P if stage == 3 else 0))
    assert states.device_total == ENGINE_TOTALS[(precision, stage, ranks)]


def test_zero1_adam_states_match_the_tutorial_oracle():
    # ZeRO tutorial: a 1.5B GPT-2 has 18 GB of fp32 master params + Adam states; stage 1 on 8 ranks: 2.25 GB.
    states = model_state_bytes(spec(total_params=1_500_000_000, zero_stage=1))
    assert states.device_master_params + states.device_optimizer_states == 2_250_000_000


def test_stage3_keeps_small_parameters_gathered_besides_the_partition():
    small = 1_000_000
    with_small = model_state_bytes(spec(zero_stage=3, small_params=small))
    without = model_state_bytes(spec(zero_stage=3))
    assert with_small.device_params - without.device_params == small * 2


def test_optimizer_offload_to_cpu_moves_the_optimizer_side_to_host():
    states = model_state_bytes(spec(zero_stage=2, offload_optimizer="cpu"))
    assert states.device_optimizer_states == states.device_master_params == states.device_gradients == 0
    assert states.device_params == 2 * P
    assert states.host == (4 + 4 + 8) * P // 8  # fp32 params, fp32 grads, two moments
    assert states.nvme == 0


def test_stage1_offload_keeps_whole_gradients_on_device():
    assert model_state_bytes(spec(zero_stage=1, offload_optimizer="cpu")).device_gradients == 2 * P


def test_fp32_offload_still_needs_an_fp32_copy_on_host():
    states = model_state_bytes(spec(zero_stage=2, offload_optimizer="cpu", precision="fp32"))
    assert states.device_params == 4 * P and states.host == 16 * P // 8


def test_nvme_offload_puts_states_on_nvme_with_host_swap_buffers():
    states = model_state_bytes(spec(zero_stage=3, offload_optimizer="nvme", offload_param="nvme",
                                    buffers=BufferSettings(sub_group_size=10_000_000)))
    part = P // 8
    # master, 16-bit gradient (one micro-step per step: exact in bf16), Adam states; 16-bit params
    assert states.nvme == part * (4 + 2 + 8) + part * 2
    accumulating = model_state_bytes(spec(zero_stage=3, offload_optimizer="nvme", offload_param="nvme",
                                          gradient_accumulation_steps=4))
    assert accumulating.nvme == part * (4 + 4 + 8) + part * 2  # summed over micro-steps: an fp32 gradient
    assert states.host == 0  # gradients are swapped out sub-group by sub-group, not gathered in RAM
    chunk = min(part, 10_000_000)
    # buffer_count fp32 buffers of one sub-group; one pipeline slot (4 buffers) -> one bf16 output tile; the
    # parameter pool (5 whole buffers of 1e8 elements) and up to max_in_cpu cached shards
    assert states.host_buffers == 4 * chunk * 4 + chunk * 2 + (5 * 100_000_000 + min(1_000_000_000, part)) * 2
    assert states.device_total == 0


def test_frozen_parameters_have_no_gradients_or_optimizer_states():
    frozen = model_state_bytes(spec(zero_stage=0, trainable_params=0))
    assert frozen.device_total == 2 * P


def test_init_needs_the_fp32_model_unless_zero_init_partitions_it():
    assert init_bytes_per_rank(spec(zero_stage=2)) == 4 * P
    assert init_bytes_per_rank(spec(zero_stage=3)) == 4 * (P // 8 + P // 100)
    assert init_bytes_per_rank(spec(zero_stage=3, zero_init=False)) == 4 * P


@pytest.mark.parametrize("kw, key", [
    (dict(zero_stage=0, offload_optimizer="cpu"), "zero_optimization.offload_optimizer"),
    (dict(zero_stage=2, offload_optimizer="nvme"), "zero_optimization.offload_optimizer.device"),
    (dict(zero_stage=2, offload_param="cpu"), "zero_optimization.offload_param"),
    (dict(zero_stage=4), "zero_optimization.stage"),
    (dict(precision="fp8"), "precision"),
    (dict(ranks_per_node=0), "ranks_per_node"),
])
def test_invalid_inputs_name_the_key(kw, key):
    with pytest.raises(ConfigError) as err:
        spec(**kw)
    assert str(err.value).startswith(key + ":")


def test_buffer_settings_read_a_zero_section_with_float_numbers():
    b = BufferSettings.from_zero_config({"reduce_bucket_size": 5e7, "overlap_comm": True,
                                         "offload_param": {"device": "nvme", "buffer_count": 3}})
    assert (b.reduce_bucket_size, b.overlap_comm, b.offload_param_buffer_count) == (50_000_000, True, 3)
    assert b.allgather_bucket_size == 500_000_000


@pytest.mark.parametrize("stage", [0, 1])
def test_onebit_adam_adds_its_error_buffers(stage):
    # the worker error over every trainable element on each of the 8 ranks, the server error over 1/8 of them
    adam = model_state_bytes(spec(zero_stage=stage, optimizer="AdamW"))
    onebit = model_state_bytes(spec(zero_stage=stage, optimizer="OneBitAdam"))
    assert onebit.device_optimizer_states - adam.device_optimizer_states == 4 * P + 4 * P // 8
    assert onebit.device_step_workspace == 8 * P  # the exchange's fp32 input and output, whole-group sized


def test_mics_partitions_model_states_over_its_shard_group_and_hpz_adds_the_secondary_partition():
    """8 ranks, bf16 AdamW at stage 3: MiCS over shard groups of 2 holds what plain ZeRO-3 on 2 ranks holds
    (4x the 8-rank partition), hpZ over 4 ranks adds the bf16 secondary partition, P * 2 / 4 bytes. Neither
    changes anything below stage 3."""
    plain8, plain2 = model_state_bytes(spec(zero_stage=3)), model_state_bytes(spec(zero_stage=3, ranks_per_node=2))
    mics = model_state_bytes(spec(zero_stage=3, mics_shard_size=2))
    assert mics == plain2 and mics.device_total == 4 * plain8.device_total
    hpz = model_state_bytes(spec(zero_stage=3, hpz_partition_size=4))
    assert hpz.device_params == plain8.device_params + P * 2 // 4
    assert hpz.device_total - plain8.device_total == P // 2
    assert init_bytes_per_rank(spec(zero_stage=3, mics_shard_size=2)) == (P // 2 + P // 100) * 4
    for key in ("mics_shard_size", "hpz_partition_size"):
        assert model_state_bytes(spec(zero_stage=2, **{key: 2})) == model_state_bytes(spec(zero_stage=2))
        with pytest.raises(ConfigError, match="must divide the 8 ranks"):
            spec(zero_stage=3, **{key: 3})


def test_quantized_nontrainable_weights_keep_the_frozen_partition_int8():
    """Stage 3, bf16, 8 ranks, half the parameters frozen: the frozen half of the partition is held as INT8
    codes plus one fp32 scale per 256 elements instead of 2 bytes each; nothing changes without frozen
    parameters, below stage 3 or with parameter offload."""
    from dsrun.comm.quantized import message_bytes

    on = BufferSettings.from_zero_config({"zero_quantized_nontrainable_weights": True})
    frozen_part = P // 2 // 8
    plain = model_state_bytes(spec(zero_stage=3, trainable_params=P // 2))
    kept = model_state_bytes(spec(zero_stage=3, trainable_params=P // 2, buffers=on))
    assert plain.device_params - kept.device_params == 2 * frozen_part - message_bytes(frozen_part, 8, 256)
    assert kept.device_total == plain.device_total - (plain.device_params - kept.device_params)
    for kw in ({"zero_stage": 3}, {"zero_stage": 2, "trainable_params": P // 2},
               {"zero_stage": 3, "trainable_params": P // 2, "offload_param": "cpu"}):
        assert model_state_bytes(spec(**kw, buffers=on)) == model_state_bytes(spec(**kw))


def test_loco_error_buffers_add_int8_bytes_of_the_gradient_rows():
    from dsrun.comm import quantized as q

    def grads(nodes: int, **zero) -> int:
        zero = {"zero_quantized_gradients": True, **zero}
        s = EstimateInputs(total_params=1_000_000, largest_layer_params=100_000, ranks_per_node=4, nodes=nodes,
                           zero_stage=3, precision="bf16", buffers=BufferSettings.from_zero_config(zero))
        return model_state_bytes(s).device_gradients

    part = 1_000_000 // 4
    assert grads(1, zeropp_loco_param={}) - grads(1) == q.message_bytes(4 * part, 8, q.GRAD_BLOCK)
    part = 1_000_000 // 8  # two nodes: the node's partial sums get their own buffer
    assert grads(2, zeropp_loco_param={}) - grads(2) == q.message_bytes((8 + 2) * part, 8, q.GRAD_BLOCK)
