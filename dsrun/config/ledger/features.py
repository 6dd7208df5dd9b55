"""Ledger entries for DeepSpeed's training techniques and undocumented sections that dsrun does not have yet:
activation checkpointing, sparse attention, data efficiency (curriculum, random-LTD), the legacy curriculum,
progressive layer drop, compression, MoQ, eigenvalue, pipeline, hybrid engine, compile, Nebula.

These start as ``not implemented``: a config that enables them is refused. The helper who builds a feature
turns its entries into ``done(key, meaning, proof...)`` (see docs/config.md, "Flipping a key").
"""
from __future__ import annotations

from .entry import Entry, Feature, todo

ACTIVATION_CHECKPOINTING = Feature("activation checkpointing (deepspeed.checkpointing)",
                                   "leave the activation_checkpointing keys at their defaults")
SPARSE_ATTENTION = Feature("block-sparse attention", "remove the sparse_attention section")
DATA_EFFICIENCY = Feature("the data efficiency library (curriculum sampling, random-LTD)",
                          "disable data_efficiency")
CURRICULUM = Feature("curriculum learning", "disable curriculum_learning")
LAYER_DROP = Feature("progressive layer drop", "disable progressive_layer_drop")
COMPRESSION = Feature("the compression library (quantization, pruning, layer reduction)",
                      "disable the compression_training technique")
MOQ = Feature("MoQ quantize-aware training", "disable quantize_training")
EIGENVALUE = Feature("eigenvalue (Hessian) estimation", "disable eigenvalue")
PIPELINE = Feature("pipeline parallelism", "leave the pipeline keys at their defaults")
HYBRID = Feature("the hybrid train/generate engine (DeepSpeed-Chat)", "disable hybrid_engine")
COMPILE = Feature("torch.compile of the engine's module", "disable compile (call torch.compile on your model "
                  "before initialize instead)")
NEBULA = Feature("Nebula checkpointing (Azure)", "disable nebula")
INFERENCE_QUANT = Feature("DeepSpeed-Inference weight quantization", "remove weight_quantization")


def _section(prefix: str, feature: Feature, keys: dict[str, str]) -> list[Entry]:
    return [todo(f"{prefix}.{key}" if prefix else key, meaning, feature) for key, meaning in keys.items()]


_SCHEDULE = {
    "total_curriculum_step": "steps from min to max difficulty", "difficulty_step": "difficulty increments",
    "root_degree": "root of the fixed_root schedule", "difficulty": "difficulties of fixed_discrete",
    "max_step": "steps at which each next difficulty starts",
}
_METRIC = {
    "index_to_sample_path": "the analyzer's index-to-sample file", "index_to_metric_path": "the analyzer's "
    "index-to-metric file", "difficulty_type": "value or percentile", "clustering_type": "schedule_based or "
    "single_cluster", "min_difficulty": "starting difficulty", "max_difficulty": "final difficulty",
    "schedule_type": "the difficulty schedule",
    **{f"schedule_config.{k}": v for k, v in _SCHEDULE.items()},
}
_GROUP = {"modules": "module name patterns of the group", "related_modules": "modules pruned together"}


def _compression() -> list[Entry]:
    base = "compression_training"
    entries = _section(f"{base}.layer_reduction", COMPRESSION, {
        "enabled": "layer reduction (distillation into fewer layers)", "keep_number_layer": "layers kept",
        "module_name_prefix": "prefix of the layer modules", "teacher_layer": "teacher layer of each kept layer",
        "other_module_name": "other modules copied from the teacher"})
    wq = f"{base}.weight_quantization"
    entries += _section(f"{wq}.shared_parameters", COMPRESSION, {
        "enabled": "weight quantization", "quantizer_kernel": "use the CUDA quantizer kernel",
        "schedule_offset": "step at which quantization starts", "quantize_groups": "quantization groups per "
        "weight", "quantize_verbose": "log quantization", "quantization_type": "symmetric or asymmetric",
        "quantize_weight_in_forward": "quantize inside the forward", "rounding": "nearest or stochastic",
        "fp16_mixed_quantize.enabled": "mix fp16 and quantized weights while converging",
        "fp16_mixed_quantize.quantize_change_ratio": "how fast the mix moves to quantized"})
    entries += _section(f"{wq}.different_groups.*", COMPRESSION, {
        **_GROUP, "params.start_bits": "bits at the start", "params.target_bits": "bits at the end",
        "params.quantization_period": "steps per bit removed"})
    aq = f"{base}.activation_quantization"
    entries += _section(f"{aq}.shared_parameters", COMPRESSION, {
        "enabled": "activation quantization", "quantization_type": "symmetric or asymmetric",
        "range_calibration": "dynamic or static range", "schedule_offset": "step at which it starts"})
    entries += _section(f"{aq}.different_groups.*", COMPRESSION, {**_GROUP, "params.bits": "activation bits"})
    for technique, shared in (
            ("sparse_pruning", {"enabled": "unstructured (sparse) pruning", "method": "l1, topk or snip_momentum",
                                "schedule_offset": "step at which pruning starts",
                                "schedule_offset_end": "step at which snip_momentum stops",
                                "schedule_offset_stride": "steps between snip_momentum updates",
                                "block_pattern": "NxM or N:M block pattern", "dense_ratio": "fraction kept",
                                "excluded_modules": "modules never pruned"}),
            ("row_pruning", {"enabled": "row pruning", "method": "l1 or topk",
                             "schedule_offset": "step at which pruning starts"}),
            ("head_pruning", {"enabled": "attention head pruning", "method": "topk",
                              "schedule_offset": "step at which pruning starts", "num_heads": "heads per layer"}),
            ("channel_pruning", {"enabled": "convolution channel pruning", "method": "l1 or topk",
                                 "schedule_offset": "step at which pruning starts"})):
        entries += _section(f"{base}.{technique}.shared_parameters", COMPRESSION, shared)
        entries += _section(f"{base}.{technique}.different_groups.*", COMPRESSION,
                            {**_GROUP, "params.dense_ratio": "fraction kept"})
    return entries


def _data_efficiency() -> list[Entry]:
    de = "data_efficiency"
    sampling = f"{de}.data_sampling"
    cl = f"{sampling}.curriculum_learning"
    ltd = f"{de}.data_routing.random_ltd"
    return [
        *_section(de, DATA_EFFICIENCY, {"enabled": "the data efficiency library", "seed": "its random seed"}),
        *_section(sampling, DATA_EFFICIENCY, {"enabled": "curriculum data sampling", "num_epochs": "epochs the "
                  "sampler covers", "num_workers": "sampler workers", "pin_memory": "pinned sampler memory"}),
        *_section(cl, DATA_EFFICIENCY, {"enabled": "curriculum learning by data difficulty",
                                        "data_cluster_path": "folder of the difficulty clusters"}),
        *_section(f"{cl}.curriculum_metrics.*", DATA_EFFICIENCY, _METRIC),
        *_section(f"{de}.data_routing", DATA_EFFICIENCY, {"enabled": "data routing (random-LTD)"}),
        *_section(ltd, DATA_EFFICIENCY, {
            "enabled": "random layerwise token dropping", "total_layer_num": "layers of the model",
            "random_ltd_layer_num": "layers that drop tokens", "random_ltd_layer_id": "which layers drop tokens",
            "model_mask_name": "the forward's attention-mask argument (null: none)", "model_type": "decoder or "
            "encoder", "hidden_state_order": "batch_seq_dim or seq_batch_dim",
            "random_ltd_schedule.min_value": "kept tokens at the start", "random_ltd_schedule.max_value": "kept "
            "tokens at the end", "random_ltd_schedule.schedule_type": "fixed_linear",
            "random_ltd_schedule.schedule_config.require_steps": "steps from min to max",
            "random_ltd_schedule.schedule_config.seq_per_step": "kept length granularity",
            "layer_token_lr_schedule.enabled": "scale the learning rate by layer tokens",
            "layer_token_lr_schedule.total_layer_tokens": "layer tokens of the whole run",
            "layer_token_lr_schedule.warmup_type": "linear or log", "layer_token_lr_schedule.warmup_layer_tokens":
            "layer tokens of the warmup"}),
    ]


def _quantize_training() -> list[Entry]:
    return _section("quantize_training", MOQ, {
        "enabled": "MoQ: quantize weights during training", "quantize_verbose": "log quantization",
        "quantizer_kernel": "use the CUDA quantizer kernel", "quantize_bits.start_bits": "bits at the start",
        "quantize_bits.target_bits": "bits at the end", "quantize_schedule.quantize_period": "steps per bit "
        "removed", "quantize_schedule.schedule_offset": "step at which quantization starts",
        "quantize_groups": "quantization groups per weight", "quantize_algo.q_type": "symmetric or asymmetric",
        "quantize_algo.rounding": "nearest or stochastic", "fp16_mixed_quantize.enabled": "mix fp16 and "
        "quantized weights", "fp16_mixed_quantize.quantize_change_ratio": "how fast the mix moves"})


ENTRIES: list[Entry] = [
    *_section("activation_checkpointing", ACTIVATION_CHECKPOINTING, {
        "partition_activations": "partition checkpointed activations across model-parallel ranks",
        "cpu_checkpointing": "move checkpointed activations to the CPU",
        "contiguous_memory_optimization": "copy checkpoints into one contiguous buffer",
        "number_checkpoints": "checkpoints per forward (sizes the contiguous buffer)",
        "synchronize_checkpoint_boundary": "synchronize the device at each checkpoint",
        "profile": "time the checkpointed forward and recomputation"}),
    *_section("sparse_attention", SPARSE_ATTENTION, {
        "mode": "dense, fixed, bigbird, bslongformer or variable", "block": "block size",
        "different_layout_per_head": "a layout per head", "num_local_blocks": "local window in blocks",
        "num_global_blocks": "global blocks", "attention": "unidirectional or bidirectional",
        "horizontal_global_attention": "global blocks also attend horizontally",
        "num_different_global_patterns": "distinct global patterns", "num_random_blocks": "random blocks",
        "local_window_blocks": "local window sizes in blocks", "global_block_indices": "global block starts",
        "global_block_end_indices": "global block ends", "num_sliding_window_blocks": "sliding window in blocks"}),
    *_data_efficiency(),
    *_section("curriculum_learning", CURRICULUM, {
        "enabled": "legacy curriculum learning (sequence length)", "curriculum_type": "seqlen",
        "min_difficulty": "starting difficulty", "max_difficulty": "final difficulty",
        "schedule_type": "the difficulty schedule", **{f"schedule_config.{k}": v for k, v in _SCHEDULE.items()}}),
    *_section("progressive_layer_drop", LAYER_DROP, {
        "enabled": "progressive layer drop", "theta": "final keep probability", "gamma": "how fast it is reached"}),
    *_compression(),
    *_section("eigenvalue", EIGENVALUE, {
        "enabled": "estimate the top Hessian eigenvalue per block", "verbose": "log the estimates",
        "max_iter": "power-iteration steps", "tol": "convergence tolerance", "stability": "added to the "
        "denominator", "gas_boundary_resolution": "estimate every this many steps", "layer_name": "the blocks' "
        "module name", "layer_num": "number of blocks"}),
    *_quantize_training(),
    *_section("pipeline", PIPELINE, {
        "stages": "pipeline stages", "partition": "how layers are split over stages",
        "seed_layers": "seed each layer's initialization", "activation_checkpoint_interval": "layers per "
        "activation checkpoint", "pipe_partitioned": "partition activations between stages",
        "grad_partitioned": "partition gradients between stages"}),
    *_section("hybrid_engine", HYBRID, {
        "enabled": "switch between training and generation engines", "max_out_tokens": "longest generation",
        "inference_tp_size": "tensor parallelism while generating", "release_inference_cache": "free the "
        "KV cache after generating", "pin_parameters": "pin gathered parameters", "tp_gather_partition_size":
        "partitions gathered at once"}),
    *_section("compile", COMPILE, {
        "enabled": "torch.compile the model", "backend": "the compile backend", "kwargs": "torch.compile "
        "arguments"}),
    *_section("nebula", NEBULA, {
        "enabled": "save checkpoints through Nebula", "load_path": "where to load from",
        "enable_nebula_load": "load through Nebula", "persistent_storage_path": "persistent storage",
        "persistent_time_interval": "seconds between persists", "num_of_version_in_retention": "versions kept"}),
    todo("weight_quantization", "DeepSpeed-Inference weight quantization settings", INFERENCE_QUANT),
]
