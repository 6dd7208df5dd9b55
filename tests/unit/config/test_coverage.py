"""Every key row of the reference key inventory (config-keys.md §2, 253 rows) is known to the schema, and
the undocumented keys DeepSpeed reads (§6) are accepted too."""
from __future__ import annotations

import typing
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel

from dsrun.config import DSConfig, load_ds_config

CASES = Path(__file__).parent / "cases"
DOCUMENTED = [line.strip() for line in (CASES / "documented_keys.txt").read_text().splitlines() if line.strip()]
# Documented keys that the migration rewrites (deprecated or DeepSpeed-ignored spellings).
MIGRATED = {"zero_optimization.cpu_offload", "elasticity.prefer_large_batch"}
# Open dicts: any key below them is accepted.
OPEN = {"optimizer.params", "scheduler.params"}


def _model_in(annotation: typing.Any) -> typing.Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _dict_value_model(annotation: typing.Any) -> typing.Any:
    for arg in typing.get_args(annotation):
        origin = typing.get_origin(arg)
        if origin is dict:
            return _model_in(typing.get_args(arg)[1])
    if typing.get_origin(annotation) is dict:
        return _model_in(typing.get_args(annotation)[1])
    return None


def schema_knows(dotted: str) -> bool:
    model: typing.Any = DSConfig
    parts = dotted.split(".")
    i = 0
    while i < len(parts):
        part = parts[i]
        if part == "<extra>":
            return model.model_config.get("extra") == "allow"
        if part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        if ".".join(parts[: i + 1]) in OPEN:
            return True
        if i + 1 < len(parts) and parts[i + 1].startswith("<") and parts[i + 1] != "<extra>":
            model = _dict_value_model(annotation)
            i += 2
            if model is None:
                return False
            continue
        nested = _model_in(annotation)
        if i + 1 < len(parts):
            if nested is None:
                return False
            model = nested
        i += 1
    return True


def test_inventory_has_all_253_rows():
    assert len(DOCUMENTED) == 253
    assert len(set(DOCUMENTED)) == 253


@pytest.mark.parametrize("key", DOCUMENTED)
def test_documented_key_is_in_the_schema(key):
    assert key in MIGRATED or schema_knows(key), key


UNDOCUMENTED = [
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown", "disable_allgather",
    "dataloader_drop_last", "vocabulary_size", "seq_parallel_comm_data_type", "graph_harvesting",
    "use_data_before_expert_parallelism", "hybrid_engine.enabled", "compile.backend", "timers.throughput.enabled",
    "nebula.enabled", "weight_quantization", "eigenvalue.enabled", "eigenvalue.verbose", "eigenvalue.max_iter",
    "eigenvalue.tol", "eigenvalue.stability", "eigenvalue.gas_boundary_resolution", "eigenvalue.layer_name",
    "eigenvalue.layer_num", "progressive_layer_drop.enabled", "progressive_layer_drop.theta",
    "progressive_layer_drop.gamma", "pipeline.stages", "pipeline.partition", "pipeline.seed_layers",
    "pipeline.activation_checkpoint_interval", "pipeline.pipe_partitioned", "pipeline.grad_partitioned",
    "optimizer.legacy_fusion", "fp16.fp16_master_weights_and_grads", "bf16.immediate_grad_update",
    "flops_profiler.recompute_fwd_factor", "autotuning.metric_path", "autotuning.min_train_batch_size",
    "autotuning.max_train_micro_batch_size_per_gpu", "autotuning.min_train_micro_batch_size_per_gpu",
    "autotuning.model_info_path", "autotuning.model_info.profile", "autotuning.model_info.num_params",
    "autotuning.model_info.hidden_size", "autotuning.model_info.num_layers",
    "zero_optimization.use_multi_rank_bucket_allreduce", "zero_optimization.stage3_model_persistence_threshold",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params", "zero_optimization.zero_quantized_nontrainable_weights",
    "zero_optimization.mics_shard_size", "zero_optimization.mics_hierarchical_params_gather",
    "zero_optimization.memory_efficient_linear", "zero_optimization.pipeline_loading_checkpoint",
    "zero_optimization.override_module_apply", "zero_optimization.legacy_stage1",
    "zero_optimization.offload_optimizer.pipeline_read", "zero_optimization.offload_optimizer.pipeline_write",
    "mlflow.enabled", "mlflow.tracking_uri", "mlflow.experiment_name", "mlflow.run_name", "mlflow.log_artifacts",
]


@pytest.mark.parametrize("key", UNDOCUMENTED)
def test_undocumented_deepspeed_key_is_in_the_schema(key):
    assert schema_knows(key), key


@pytest.mark.parametrize("zero_key, value", [
    ("cpu_offload_param", True), ("cpu_offload_use_pin_memory", True),
    ("stage3_gather_fp16_weights_on_model_save", True), ("prefetch_bucket_size", 1000),
    ("param_persistence_threshold", 10), ("model_persistence_threshold", 10), ("max_live_parameters", 10),
    ("max_reuse_distance", 10), ("gather_16bit_weights_on_model_save", True),
    ("use_all_reduce_for_fetch_params", True), ("module_granularity_threshold", 5),
])
def test_migrated_or_aliased_zero_keys_are_accepted(zero_key, value):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, zero_key: value},
              "dsrun_allow_unimplemented": True}  # some of these keys are not implemented: schema only here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_ds_config(config)
    assert zero_key not in cfg.to_ds_dict()["zero_optimization"]


def test_mlflow_defaults():
    cfg = load_ds_config({"train_micro_batch_size_per_gpu": 1})
    assert (cfg.mlflow.enabled, cfg.mlflow.tracking_uri, cfg.mlflow.experiment_name, cfg.mlflow.run_name,
            cfg.mlflow.log_artifacts) == (False, None, "dsrun", None, True)
