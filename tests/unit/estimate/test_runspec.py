"""From a RunSpec to estimator inputs: meta-device model building, counting, and where each number comes from."""
from __future__ import annotations

from dataclasses import replace

import psutil
import pytest
import torch
from omegaconf import OmegaConf

from dsrun.estimate import count_parameters, estimate_peak_bytes_per_rank
from dsrun.estimate.peak import activation_bytes
from dsrun.estimate.runspec import build_recipe_model, inputs_from_runspec, small_parameter_count
from dsrun.utils.errors import ConfigError
from tests.unit.estimate.tiny_gpt import TinyGPT

TINY = {"_target_": "tests.unit.estimate.tiny_gpt.TinyGPT", "vocab_size": 512, "block_size": 64, "n_layer": 2,
        "n_head": 4, "n_embd": 64}


def runspec(**sections):
    base = {
        "model": dict(TINY),
        "data": {"seq_len": 32},
        "train": {"activation_checkpointing": True},
        "launcher": {"num_nodes": 2, "num_procs": 4},
        "ds": {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True},
               "optimizer": {"type": "Lion", "params": {"lr": 1e-4}},
               "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "stage3_param_persistence_threshold": 1000, "reduce_bucket_size": 5e6}},
    }
    base.update(sections)
    return OmegaConf.create(base)


def test_meta_model_counts_equal_the_real_models():
    real = count_parameters(TinyGPT(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64))
    meta = build_recipe_model(runspec())
    assert meta.counts == real
    assert all(p.device.type == "meta" for p in meta.module.parameters())
    # the tied LM head is counted once: total = embeddings + blocks + final norm, without a second 512x64
    assert real.total == sum(p.numel() for p in meta.module.parameters())
    assert real.largest_layer == 512 * 64 and real.largest_layer_name == "wte"


def test_shared_parameters_on_real_tensors_are_counted_once_by_storage():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    model[1].weight = torch.nn.Parameter(model[0].weight.data)  # distinct Parameter, same storage
    assert count_parameters(model).total == 16


def test_inputs_come_from_the_runspec_with_their_sources():
    cfg = runspec()
    spec, sources = inputs_from_runspec(cfg, build_recipe_model(cfg))
    assert (spec.nodes, spec.ranks_per_node, spec.world_size) == (2, 4, 8)
    assert (spec.zero_stage, spec.offload_optimizer, spec.offload_param) == (3, "cpu", "none")
    assert (spec.precision, spec.optimizer, spec.micro_batch_size, spec.seq_len) == ("bf16", "Lion", 3, 32)
    assert spec.activation_checkpointing == "full"
    assert spec.buffers.reduce_bucket_size == 5_000_000
    assert spec.model_shape.n_layer == 2 and spec.model_shape.vocab_size == 512
    assert spec.small_params == small_parameter_count(build_recipe_model(cfg).module, 1000) > 0
    assert sources["precision"] == "ds.bf16.enabled" and sources["seq_len"] == "data.seq_len"
    assert sources["ranks_per_node"] == "launcher.num_procs"
    assert estimate_peak_bytes_per_rank(spec).activations > 0


def test_defaults_and_derived_values_when_keys_are_missing():
    cfg = runspec(data={}, train={}, launcher={"nproc_per_node": 2},
                  ds={"train_micro_batch_size_per_gpu": "auto", "train_batch_size": 16,
                      "gradient_accumulation_steps": 2})
    spec, sources = inputs_from_runspec(cfg, build_recipe_model(cfg))
    assert spec.micro_batch_size == 4  # 16 / 2 accumulation steps / 2 ranks
    assert spec.seq_len == 64 and sources["seq_len"] == "model.block_size"
    assert (spec.precision, spec.zero_stage, spec.optimizer) == ("fp32", 0, "adam")
    assert sources["zero_stage"] == "default" and spec.activation_checkpointing == "none"


def test_gradient_clipping_left_out_is_deepspeeds_default_as_the_engine_clips():
    """A ds section without gradient_clipping clips at 1.0 in the engine, so the ZeRO-3 estimate counts the
    norm's temporaries; 0.0 written out turns them off."""
    from dsrun.config import DSConfig
    from dsrun.estimate.inputs import DEFAULT_CLIPPING, EstimateInputs

    assert DEFAULT_CLIPPING == EstimateInputs.gradient_clipping == DSConfig().gradient_clipping == 1.0
    cfg = runspec()
    spec, sources = inputs_from_runspec(cfg, build_recipe_model(cfg))
    assert spec.gradient_clipping == 1.0 and sources["gradient_clipping"].startswith("default")
    off = runspec(ds={**OmegaConf.to_container(cfg.ds), "gradient_clipping": 0.0})
    spec, sources = inputs_from_runspec(off, build_recipe_model(off))
    assert spec.gradient_clipping == 0.0 and sources["gradient_clipping"] == "ds.gradient_clipping"


def test_a_recipe_without_a_model_is_a_user_error():
    with pytest.raises(ConfigError, match="model._target_"):
        build_recipe_model(OmegaConf.create({"model": {}}))


def test_ten_billion_parameter_gpt_is_counted_without_its_weights():
    # Timing is not asserted (the machine is shared and noisy); docs/estimate.md records measured times.
    cfg = runspec(model={"_target_": "tests.unit.estimate.tiny_gpt.TinyGPT", "vocab_size": 50304,
                         "block_size": 2048, "n_layer": 50, "n_head": 32, "n_embd": 4096},
                  data={"seq_len": 2048})
    build_recipe_model(runspec())  # warm up imports so only the big model is measured
    process = psutil.Process()
    rss_before = process.memory_info().rss
    model = build_recipe_model(cfg)
    spec, _ = inputs_from_runspec(cfg, model)
    estimate = estimate_peak_bytes_per_rank(spec)
    rss_growth = process.memory_info().rss - rss_before
    assert model.counts.total > 10_000_000_000
    assert estimate.peak_per_rank > 0
    assert rss_growth < 200 * 2**20, f"RSS grew by {rss_growth / 2**20:.0f} MiB"  # 10B fp32 weights: 40 GB


def test_meta_build_skips_weight_init_but_keeps_shapes_dtypes_and_frozen_flags():
    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 16)
            self.table = torch.nn.Embedding(32, 8)
            self.scale = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
            torch.nn.init.trunc_normal_(self.proj.weight, std=0.02)
            torch.nn.init.normal_(tensor=self.table.weight)
            self.table.weight.data.mul_(0.5).add_(1.0)
            self.table.weight.requires_grad_(False)

    from dsrun.estimate.counting import meta_device

    real = Custom()
    with meta_device():
        meta = Custom()
    for (name, r), (_, m) in zip(real.named_parameters(), meta.named_parameters(), strict=True):
        assert (m.shape, m.dtype, m.requires_grad, m.device.type) == (r.shape, r.dtype, r.requires_grad, "meta"), name
    assert count_parameters(meta) == count_parameters(real)
    assert count_parameters(meta).trainable == count_parameters(meta).total - 32 * 8


def test_sequence_parallel_size_divides_each_ranks_activations():
    ds = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}
    plain_cfg = runspec(train={}, launcher={"num_procs": 4}, ds=ds)
    ulysses_cfg = runspec(train={}, launcher={"num_procs": 4}, ds={**ds, "sequence_parallel_size": 2})
    plain, _ = inputs_from_runspec(plain_cfg, build_recipe_model(plain_cfg))
    ulysses, sources = inputs_from_runspec(ulysses_cfg, build_recipe_model(ulysses_cfg))
    # 16 samples / 2 accumulation steps over 4 / 2 = 2 data-parallel replicas (a sequence group shares samples)
    assert (plain.micro_batch_size, ulysses.micro_batch_size) == (2, 4)
    assert ulysses.sequence_parallel_size == 2 and sources["sequence_parallel_size"] == "ds.sequence_parallel_size"
    same_batch, split = activation_bytes(replace(plain, micro_batch_size=4)), activation_bytes(ulysses)
    # every term is halved (the exchanges keep nothing more: docs/sequence_parallel.md)
    assert split.head == same_batch.head // 2 and split.workspace == same_batch.workspace // 2
    assert split.blocks == same_batch.blocks // 2 and split.per_block == same_batch.per_block // 2
    # model states do not change: ZeRO partitions over every rank, data x sequence
    assert estimate_peak_bytes_per_rank(ulysses).model_states == estimate_peak_bytes_per_rank(plain).model_states


def test_ds_settings_come_from_the_typed_sections_with_the_estimators_own_choices_kept() -> None:
    """inputs_from_runspec reads dsrun.config's typed sections: legacy keys are migrated as a run migrates them;
    where the estimator's default differs from the schema's it is kept: no optimizer.type is Adam (the schema:
    None), an unset overlap_comm stays None so that it follows a stage changed afterwards (the schema settles
    it for the config's own stage)."""
    from omegaconf import OmegaConf

    from dsrun.estimate.inputs import BufferSettings

    model = build_recipe_model(OmegaConf.create({"model": {"_target_": "torch.nn.Linear", "in_features": 4,
                                                           "out_features": 4}}))
    spec, sources = inputs_from_runspec(OmegaConf.create({"ds": {"bfloat16": {"enabled": True},
                                                                 "zero_optimization": True}}), model)
    assert (spec.precision, spec.zero_stage, spec.optimizer) == ("bf16", 1, "adam")
    assert sources["optimizer"] == "default" and sources["zero_stage"] == "ds.zero_optimization.stage"
    assert spec.buffers.overlap_comm is None and spec.with_(zero_stage=3).overlap_comm is True
    assert spec.buffers == BufferSettings()  # every other buffer setting: the schema's default, the same numbers


def test_autotp_counts_one_ranks_split_model_and_zero_partitions_over_the_data_parallel_ranks() -> None:
    from dsrun.models.gpt import GPT
    from dsrun.tensor_parallel.split import split_for_training, split_meta_model

    ds = {"train_batch_size": 8, "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}
    shape = {"vocab_size": 512, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64}
    cfg = runspec(model={"_target_": "dsrun.models.gpt.GPT", **shape}, train={}, launcher={"num_procs": 4}, ds=ds)
    model = build_recipe_model(cfg, split=split_meta_model)
    real = GPT(**shape)
    whole, largest = count_parameters(real).total, count_parameters(real).largest_layer
    split_for_training(real, None, 0, 2)  # what rank 0 of a TP=2 group holds (the slices' bytes, counted)
    assert (model.tp_size, model.unsplit_params, model.counts.total) == (2, whole, count_parameters(real).total)
    assert model.counts.total < whole * 0.75  # the blocks' matrices (most of the model) are halved
    spec, sources = inputs_from_runspec(cfg, model)
    assert (spec.tensor_parallel_size, spec.data_parallel_size, spec.partition_ranks) == (2, 2, 2)
    assert spec.micro_batch_size == 4  # 8 samples over 4 / 2 = 2 data-parallel ranks
    assert sources["tensor_parallel_size"] == "ds.tensor_parallel.autotp_size (counts: one rank's split model)"
    # the same run counted whole over every rank (what the estimator did before it knew the split)
    unsplit = replace(spec, total_params=whole, largest_layer_params=largest, tensor_parallel_size=1,
                      unsplit_params=None, ranks_per_node=2)
    tp, dp = estimate_peak_bytes_per_rank(spec), estimate_peak_bytes_per_rank(unsplit)
    assert tp.model_states < dp.model_states and tp.activations < dp.activations
    # every rank builds (and broadcasts) the whole model before the split
    assert tp.init_per_rank == dp.init_per_rank
    # without the split the counts stay whole (an over-estimate), but the layout is still the TP one
    counted_whole = build_recipe_model(cfg)
    assert counted_whole.counts.total == whole and inputs_from_runspec(cfg, counted_whole)[0].data_parallel_size == 2


def test_kept_fp32_modules_count_4_bytes_per_parameter_and_16_bit_gradient() -> None:
    """data_types.keep_in_fp32_modules: the kept elements, counted from the model's shapes as the engine's cast
    matches them (a regular expression searched in each name), take 4 bytes where a bf16 model holds 2: the
    parameters (stage 3: this rank's partition), stages 0-1's whole gradients and stage 1's received piece, stage 2's
    bucket pool (fp32 buckets of their own); masters and states as any other parameter's."""
    from dsrun.estimate.buffers import buffer_bytes
    from dsrun.estimate.model_states import checkpoint_bytes, model_state_bytes

    ds = {"train_micro_batch_size_per_gpu": 3, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"},
          "zero_optimization": {"stage": 3}, "data_types": {"keep_in_fp32_modules": ["c_fc", "ln_"]}}
    cfg = runspec(ds=ds)  # TinyGPT: 2 layers, n_embd 64, biases; 2 nodes x 4 ranks
    spec, sources = inputs_from_runspec(cfg, build_recipe_model(cfg))
    e = 64
    kept = 2 * (e * 4 * e + 4 * e + 2 * (2 * e)) + 2 * e  # per layer c_fc and ln_1, ln_2; then ln_f
    assert (spec.kept_fp32_params, spec.kept_trainable) == (kept, kept)
    assert sources["kept_fp32_params"] == "ds.data_types.keep_in_fp32_modules"
    plain = replace(spec, kept_fp32_params=0, kept_fp32_trainable=None)
    n = spec.data_parallel_size
    part = -(-kept // n)
    for stage, params, grads in ((0, 2 * kept, 2 * kept), (1, 2 * kept, 2 * kept + 2 * part), (2, 2 * kept, 0),
                                 (3, 2 * part, 0)):
        with_kept, without = model_state_bytes(spec.with_(zero_stage=stage)), model_state_bytes(
            plain.with_(zero_stage=stage))
        assert with_kept.device_params - without.device_params == params, stage
        assert with_kept.device_gradients - without.device_gradients == grads, stage
        assert (with_kept.device_master_params, with_kept.device_optimizer_states) == (
            without.device_master_params, without.device_optimizer_states), stage
    # stage 2's pool: a bucket (all of the rest, all of the kept) and its received piece, in bf16 and in fp32
    rest = spec.trainable - kept
    pool = (rest + -(-rest // n)) * 2 + (kept + part) * 4
    assert buffer_bytes(spec.with_(zero_stage=2)).reduce_bucket == pool
    assert checkpoint_bytes(spec) - checkpoint_bytes(plain) == 2 * kept
    # fp32 training keeps everything fp32 already: nothing is added
    fp32 = inputs_from_runspec(runspec(ds={**ds, "bf16": {"enabled": False}}), build_recipe_model(cfg))[0]
    assert fp32.kept_fp32_params == 0
