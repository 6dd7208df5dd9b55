"""Ledger entries for DeepSpeed's training techniques and undocumented sections. Implemented, each key with the
tests that change it and see the effect: activation checkpointing, sparse attention, data efficiency
(curriculum, random-LTD), the legacy curriculum, progressive layer drop, compression, MoQ, eigenvalue, pipeline,
compile. Not implemented (a config that enables them is refused): the hybrid engine, Nebula, inference weight
quantization and random-LTD's layer-token learning-rate schedule.

The implemented entries here are ``traced=False``: the tracer's short engine runs
(tests/unit/runtime/test_config_reads.py) do not switch these features on; each key's proof is a test of the
feature that changes the key and sees what it does (the tables in docs/compression.md,
docs/activation_checkpointing.md, docs/sparse_attention.md, docs/data_efficiency.md, docs/pipeline.md).
"""
from __future__ import annotations

from .entry import Entry, Feature, design, done, todo

HE = "tests/integration/test_hybrid_engine.py::"
NEBULA = Feature("Nebula checkpointing (Azure)", "disable nebula")
LAYER_TOKEN_LR = Feature("random-LTD's layer-token learning-rate schedule (DeepSpeed raises NotImplementedError "
                         "too)", "disable layer_token_lr_schedule")

AC, AC_RANKS = "tests/unit/runtime/test_checkpointing_config.py::", "tests/integration/test_activation_checkpointing.py::"
SPARSE = "tests/unit/models/test_gpt_sparse.py::"
PIPE, PIPE_RANKS = "tests/unit/pipe/test_module.py::", "tests/integration/test_pipe.py::"
DE_ENGINE, DE_SAMPLER = "tests/unit/runtime/test_data_efficiency_engine.py::", \
    "tests/unit/data_pipeline/test_analyzer_sampler.py::"
DE_SCHEDULES, DE_LTD = "tests/unit/data_pipeline/test_schedules.py::", "tests/unit/data_pipeline/test_random_ltd.py::"
CMP = "tests/unit/compression/"
QT, PRUNE, SCHED, ENGINE = (f"{CMP}test_quantization_training.py::", f"{CMP}test_pruning.py::",
                            f"{CMP}test_schedules.py::", f"{CMP}test_engine.py::")
SWITCH = f"{SCHED}test_each_technique_switches_on_at_its_schedule_offset"
KERNEL = ("dsrun has one quantizer computing the same grids as DeepSpeed's CUDA quantization kernel, so there "
          "is nothing to switch (a test shows identical results)")
RELATED = ("DeepSpeed reads related_modules only in row, head and channel pruning; dsrun refuses a value here at "
           "validation (config/compression.py) instead of ignoring it")


def _section(prefix: str, feature: Feature, keys: dict[str, str]) -> list[Entry]:
    return [todo(f"{prefix}.{key}" if prefix else key, meaning, feature) for key, meaning in keys.items()]


def _done(prefix: str, keys: dict[str, str], *proof: str) -> list[Entry]:
    return [done(f"{prefix}.{key}", meaning, *proof, traced=False) for key, meaning in keys.items()]


_SCHEDULE = {
    "total_curriculum_step": "steps from min to max difficulty", "difficulty_step": "difficulty increments",
    "root_degree": "root of the fixed_root schedule", "difficulty": "difficulties of fixed_discrete",
    "max_step": "steps at which each next difficulty starts",
}
_SCHEDULE_PROOF = (f"{DE_SCHEDULES}test_fixed_linear_and_root_follow_deepspeed_at_every_step",
                   f"{DE_SCHEDULES}test_fixed_discrete_matches_the_tutorials_example")
_METRIC = {
    "index_to_sample_path": "the analyzer's index-to-sample file", "index_to_metric_path": "the analyzer's "
    "index-to-metric file", "difficulty_type": "value or percentile", "clustering_type": "schedule_based or "
    "single_cluster", "min_difficulty": "starting difficulty", "max_difficulty": "final difficulty",
    "schedule_type": "the difficulty schedule",
}


def _groups(prefix: str, keys: dict[str, str], *proof: str, related: bool) -> list[Entry]:
    entries = _done(f"{prefix}.different_groups.*", {"modules": "module name patterns of the group", **keys}, *proof)
    key = f"{prefix}.different_groups.*.related_modules"
    return entries + ([done(key, "modules pruned together", *proof, traced=False)] if related
                      else [design(key, "modules pruned together", RELATED)])


def _compression() -> list[Entry]:
    base = "compression_training"
    entries = _done(f"{base}.layer_reduction", {
        "enabled": "layer reduction (distillation into fewer layers)", "keep_number_layer": "layers kept",
        "module_name_prefix": "prefix of the layer modules", "teacher_layer": "teacher layer of each kept layer",
        "other_module_name": "other modules copied from the teacher"},
        f"{CMP}test_layer_reduction.py::test_student_layers_come_from_the_chosen_teacher_layers",
        "tests/e2e/test_compression_cli.py::test_gpt_xtc_student_learns_from_a_teacher_run")
    wq = f"{base}.weight_quantization"
    shared = f"{wq}.shared_parameters"
    entries += [
        done(f"{shared}.enabled", "weight quantization", f"{ENGINE}test_initialize_applies_and_steps_compression_training",
             SWITCH, traced=False),
        design(f"{shared}.quantizer_kernel", "use the CUDA quantizer kernel", KERNEL),
        done(f"{shared}.schedule_offset", "step at which quantization starts", SWITCH,
             f"{SCHED}test_weight_bits_drop_one_bit_every_period_after_the_offset", traced=False),
        *_done(shared, {"quantize_groups": "quantization groups per weight",
                        "quantization_type": "symmetric or asymmetric"},
               f"{QT}test_weight_groups_type_and_bits_each_change_the_weight"),
        done(f"{shared}.quantize_verbose", "log quantization", f"{QT}test_quantize_verbose_reports_bit_changes",
             traced=False),
        done(f"{shared}.quantize_weight_in_forward", "quantize inside the forward",
             f"{ENGINE}test_quantize_weight_outside_the_forward_quantizes_the_stored_bf16_weights", traced=False),
        done(f"{shared}.rounding", "nearest or stochastic", f"{QT}test_stochastic_rounding_changes_the_forward",
             traced=False),
        *_done(shared, {"fp16_mixed_quantize.enabled": "mix fp16 and quantized weights while converging",
                        "fp16_mixed_quantize.quantize_change_ratio": "how fast the mix moves to quantized"},
               f"{QT}test_mixed_quantize_blends_the_quantized_share",
               f"{SCHED}test_mixed_quantize_share_restarts_with_each_bit_width"),
    ]
    entries += _groups(wq, {"params.start_bits": "bits at the start", "params.target_bits": "bits at the end",
                            "params.quantization_period": "steps per bit removed"},
                       f"{SCHED}test_weight_bits_drop_one_bit_every_period_after_the_offset",
                       f"{QT}test_weight_groups_type_and_bits_each_change_the_weight",
                       f"{QT}test_groups_name_modules_and_first_group_wins", related=False)
    aq = f"{base}.activation_quantization"
    aq_proof = (f"{QT}test_dynamic_activation_quantization_matches_a_fake_quant_reference",
                f"{QT}test_static_range_is_a_momentum_average_fixed_in_eval",
                f"{QT}test_activation_bits_and_per_image_ranges_for_conv", SWITCH)
    entries += _done(f"{aq}.shared_parameters", {
        "enabled": "activation quantization", "quantization_type": "symmetric or asymmetric",
        "range_calibration": "dynamic or static range", "schedule_offset": "step at which it starts"}, *aq_proof)
    entries += _groups(aq, {"params.bits": "activation bits"}, *aq_proof, related=False)
    sparse = f"{base}.sparse_pruning"
    sparse_proof = (f"{PRUNE}test_l1_sparse_pruning_keeps_exactly_the_dense_ratio",
                    f"{PRUNE}test_block_pattern_4x1_prunes_whole_blocks", f"{PRUNE}test_excluded_modules_are_not_pruned",
                    f"{PRUNE}test_topk_mask_follows_learned_scores_and_freezes_at_schedule_offset_end",
                    f"{PRUNE}test_snip_momentum_prunes_to_the_schedule_by_weight_times_gradient",
                    f"{SCHED}test_l1_mask_recomputed_every_stride_until_schedule_offset_end", SWITCH)
    entries += _done(f"{sparse}.shared_parameters", {
        "enabled": "unstructured (sparse) pruning", "method": "l1, topk or snip_momentum",
        "schedule_offset": "step at which pruning starts", "schedule_offset_end": "step at which snip_momentum stops",
        "schedule_offset_stride": "steps between snip_momentum updates", "block_pattern": "NxM or N:M block pattern",
        "dense_ratio": "fraction kept", "excluded_modules": "modules never pruned"}, *sparse_proof)
    entries += _groups(sparse, {"params.dense_ratio": "fraction kept"}, *sparse_proof,
                       f"{PRUNE}test_snip_momentum_group_dense_ratio_overrides_the_shared_target", related=False)
    for technique, shared_keys, proof in (
            ("row_pruning", {"enabled": "row pruning", "method": "l1 or topk"},
             f"{PRUNE}test_row_pruning_with_related_module_shrinks_and_keeps_outputs"),
            ("head_pruning", {"enabled": "attention head pruning", "method": "topk", "num_heads": "heads per layer"},
             f"{PRUNE}test_head_pruning_removes_heads_from_gpt_attention"),
            ("channel_pruning", {"enabled": "convolution channel pruning", "method": "l1 or topk"},
             f"{PRUNE}test_channel_pruning_with_batchnorm_agrees_before_and_after_clean")):
        prefix = f"{base}.{technique}"
        entries += _done(f"{prefix}.shared_parameters",
                         {**shared_keys, "schedule_offset": "step at which pruning starts"}, proof, SWITCH)
        entries += _groups(prefix, {"params.dense_ratio": "fraction kept"}, proof, related=True)
    return entries


def _dynamic_batching(prefix: str) -> list[Entry]:
    """DeepSpeed's variable batch size and LR (after 0.14): the keys act through the loader and scheduler that
    ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`` builds; enabled and never built, the
    first step says so."""
    vb = "tests/unit/runtime/test_variable_batch.py::"
    keys = f"{vb}test_the_section_s_keys_reach_the_packing_and_the_scheduler"
    ranks = f"{vb}test_two_ranks_share_each_batch_and_the_lr_follows_its_size"
    return [
        done(f"{prefix}.enabled", "batches packed by token count, LR scaled to each batch's size", ranks,
             f"{vb}test_seqlens_come_from_the_data_analyzer_and_the_first_step_warns_when_unused", traced=False),
        done(f"{prefix}.max_tokens", "most summed sequence length in a micro-batch", ranks,
             f"{vb}test_config_refusals", traced=False),
        done(f"{prefix}.metrics_path", "where the Data Analyzer's seqlen metric is read (or written)",
             f"{vb}test_seqlens_come_from_the_data_analyzer_and_the_first_step_warns_when_unused", traced=False),
        *_done(prefix, {"lr_scaling_method": "linear, sqrt or none", "min_batch_size": "fewest samples in a "
                        "micro-batch", "max_batch_size": "most samples in a micro-batch", "sequence_picking_order":
                        "dataloader, random (seeded by data_efficiency.seed) or seqlen", "verbose": "logs each "
                        "batch's packing"}, keys, f"{vb}test_packing_equals_deepspeeds_exhaustive_search"),
    ]


def _data_efficiency() -> list[Entry]:
    de = "data_efficiency"
    sampling = f"{de}.data_sampling"
    cl = f"{sampling}.curriculum_learning"
    ltd = f"{de}.data_routing.random_ltd"
    loader = f"{DE_SAMPLER}test_seed_workers_pinning_and_clusters_reach_the_sampler_and_loader"
    sampler = (f"{DE_SAMPLER}test_sampler_serves_only_admitted_samples_in_equal_micro_batches",
               f"{DE_SAMPLER}test_sampler_percentile_and_a_second_metric",
               f"{DE_SAMPLER}test_two_schedule_based_metrics_admit_only_samples_both_allow",
               f"{DE_SAMPLER}test_sampler_names_a_missing_index")
    ltd_proof = (f"{DE_ENGINE}test_random_ltd_layer_tokens_equal_the_analytic_count",
                 f"{DE_SCHEDULES}test_random_ltd_schedule_and_layer_tokens_follow_the_formula",
                 f"{DE_LTD}test_model_mask_name_cuts_the_mask_to_the_kept_tokens",
                 f"{DE_LTD}test_gather_scatter_match_dense_reference_forward_and_backward")
    return [
        done(f"{de}.enabled", "the data efficiency library", f"{DE_ENGINE}test_an_enclosing_enabled_false_keeps_the_"
             "technique_off", f"{DE_ENGINE}test_initialize_with_training_data_returns_the_curriculum_loader",
             traced=False),
        done(f"{de}.seed", "its random seed", loader, traced=False),
        done(f"{sampling}.enabled", "curriculum data sampling",
             f"{DE_ENGINE}test_initialize_with_training_data_returns_the_curriculum_loader", traced=False),
        done(f"{sampling}.num_epochs", "epochs the sampler covers",
             f"{DE_SAMPLER}test_num_epochs_bounds_what_the_sampler_serves", traced=False),
        *_done(sampling, {"num_workers": "sampler workers", "pin_memory": "pinned sampler memory"}, loader),
        done(f"{cl}.enabled", "curriculum learning by data difficulty",
             f"{DE_ENGINE}test_initialize_with_training_data_returns_the_curriculum_loader", *sampler, traced=False),
        done(f"{cl}.data_cluster_path", "folder of the difficulty clusters", loader, traced=False),
        *_done(f"{cl}.curriculum_metrics.*", _METRIC, *sampler),
        *_done(f"{cl}.curriculum_metrics.*.schedule_config", _SCHEDULE, *_SCHEDULE_PROOF, *sampler),
        *_dynamic_batching(f"{sampling}.dynamic_batching"),
        done(f"{de}.data_routing.enabled", "data routing (random-LTD)", *ltd_proof, traced=False),
        *_done(ltd, {
            "enabled": "random layerwise token dropping", "total_layer_num": "layers of the model",
            "random_ltd_layer_num": "layers that drop tokens", "random_ltd_layer_id": "which layers drop tokens",
            "model_mask_name": "the forward's attention-mask argument (null: none)", "model_type": "decoder or "
            "encoder", "hidden_state_order": "batch_seq_dim or seq_batch_dim",
            "random_ltd_schedule.min_value": "kept tokens at the start", "random_ltd_schedule.max_value": "kept "
            "tokens at the end", "random_ltd_schedule.schedule_type": "fixed_linear",
            "random_ltd_schedule.schedule_config.require_steps": "steps from min to max",
            "random_ltd_schedule.schedule_config.seq_per_step": "kept length granularity"}, *ltd_proof),
        *_section(f"{ltd}.layer_token_lr_schedule", LAYER_TOKEN_LR, {
            "enabled": "scale the learning rate by layer tokens", "total_layer_tokens": "layer tokens of the whole run",
            "warmup_type": "linear or log", "warmup_layer_tokens": "layer tokens of the warmup"}),
    ]


def _weight_quantization() -> list[Entry]:
    """ZeRO-Inference's top-level ``weight_quantization`` (docs/inference.md)."""
    wq, test = "weight_quantization", "tests/unit/inference/test_weight_quantization.py::"
    init = f"{test}test_quantized_initialization_at_initialize_stores_bits_and_computes_within_a_step"
    zero_init = f"{test}test_zero_init_quantizes_each_weight_before_partitioning_it"
    post = f"{test}test_post_init_quant_at_initialize_replaces_the_named_layers_in_the_engine_dtype"
    refused = f"{test}test_unknown_or_unsupported_keys_are_refused_with_one_line_each"
    rule = {"num_bits": "bits per weight value (4 or 8)", "group_size": "values sharing one scale and minimum",
            "group_dim": "the weight dimension the groups run along",
            "symmetric": "false: asymmetric min/scale quantization (true is refused, as DeepSpeed asserts)"}
    entries = [done(f"{wq}.enabled", "false: nothing is quantized (DeepSpeed does not read it)", init, traced=False)]
    unused = ("DeepSpeed reads it into WeightQuantConfig (its BaseQuantConfig field) and uses it nowhere: the bits "
              "and groups are each rule's (quantized_initialization.*, post_init_quant.*.*)")
    entries += [design(f"{wq}.{key}", meaning, unused) for key, meaning in (
        ("num_bits", "bits of the section (unused)"), ("q_type", "symmetric or asymmetric (unused)"),
        ("q_groups", "groups of the section (unused)"))]
    entries += [done(f"{wq}.quantized_initialization.{key}", f"every nn.Linear/nn.Embedding weight stored quantized "
                     f"from its build (zero.Init) or at initialize: {meaning}", init, zero_init, refused, traced=False)
                for key, meaning in rule.items()]
    entries += [done(f"{wq}.post_init_quant.*.{key}", f"the layers whose name holds the key replaced by quantized "
                     f"layers at initialize: {meaning}", post, refused, traced=False) for key, meaning in rule.items()]
    return entries



def _quantize_training() -> list[Entry]:
    proof = (f"{ENGINE}test_moq_bit_schedule_through_the_engine",
             f"{ENGINE}test_moq_type_rounding_and_mixing_change_the_stored_weights",
             f"{SCHED}test_moq_period_doubles_after_each_switch")
    return [*_done("quantize_training", {
        "enabled": "MoQ: quantize weights during training", "quantize_verbose": "log quantization",
        "quantize_bits.start_bits": "bits at the start", "quantize_bits.target_bits": "bits at the end",
        "quantize_schedule.quantize_period": "steps per bit removed", "quantize_schedule.schedule_offset": "step at "
        "which quantization starts", "quantize_groups": "quantization groups per weight", "quantize_algo.q_type":
        "symmetric or asymmetric", "quantize_algo.rounding": "nearest or stochastic", "fp16_mixed_quantize.enabled":
        "mix fp16 and quantized weights", "fp16_mixed_quantize.quantize_change_ratio": "how fast the mix moves"},
        *proof), design("quantize_training.quantizer_kernel", "use the CUDA quantizer kernel", KERNEL)]


ENTRIES: list[Entry] = [
    *_done("activation_checkpointing", {
        "partition_activations": "partition checkpointed activations across model-parallel ranks",
        "cpu_checkpointing": "move checkpointed activations to the CPU",
        "contiguous_memory_optimization": "copy checkpoints into one contiguous buffer",
        "number_checkpoints": "checkpoints per forward (sizes the contiguous buffer)",
        "synchronize_checkpoint_boundary": "synchronize the device at each checkpoint",
        "profile": "time the checkpointed forward and recomputation"},
        f"{AC_RANKS}test_partitioned_activations_halve_what_each_rank_keeps_with_identical_gradients",
        f"{AC}test_configure_reads_the_section_and_arguments_override_it",
        f"{AC}test_synchronize_checkpoint_boundary_synchronizes_around_forward_and_recompute",
        f"{AC}test_profile_prints_each_checkpoints_forward_and_recompute_time",
        f"{AC}test_cpu_checkpointing_keeps_inputs_on_the_host_and_says_once_that_a_cpu_rank_has_nothing_to_move",
        f"{AC}test_initialize_configures_from_the_section"),
    *_done("sparse_attention", {
        "mode": "dense, fixed, bigbird, bslongformer or variable", "block": "block size",
        "different_layout_per_head": "a layout per head", "num_local_blocks": "local window in blocks",
        "num_global_blocks": "global blocks", "attention": "unidirectional or bidirectional",
        "horizontal_global_attention": "global blocks also attend horizontally",
        "num_different_global_patterns": "distinct global patterns", "num_random_blocks": "random blocks",
        "local_window_blocks": "local window sizes in blocks", "global_block_indices": "global block starts",
        "global_block_end_indices": "global block ends", "num_sliding_window_blocks": "sliding window in blocks"},
        f"{SPARSE}test_each_sparse_attention_key_changes_what_the_gpt_attends_to",
        f"{SPARSE}test_attention_direction_acts_through_horizontal_global_attention",
        f"{SPARSE}test_the_attention_option_passes_ds_sparse_attention_to_the_gpt"),
    *_data_efficiency(),
    *_done("curriculum_learning", {
        "enabled": "legacy curriculum learning (sequence length)", "curriculum_type": "seqlen",
        "min_difficulty": "starting difficulty", "max_difficulty": "final difficulty",
        "schedule_type": "the difficulty schedule"},
        f"{DE_ENGINE}test_legacy_curriculum_passes_curriculum_seqlen_at_global_steps_plus_one",
        f"{DE_ENGINE}test_custom_legacy_schedule_from_the_engine", *_SCHEDULE_PROOF),
    *_done("curriculum_learning.schedule_config", _SCHEDULE,
           f"{DE_ENGINE}test_legacy_curriculum_passes_curriculum_seqlen_at_global_steps_plus_one", *_SCHEDULE_PROOF),
    *_done("progressive_layer_drop", {
        "enabled": "progressive layer drop", "theta": "final keep probability", "gamma": "how fast it is reached"},
        f"{DE_ENGINE}test_pld_passes_theta_and_get_pld_theta_follows_the_schedule",
        f"{DE_SCHEDULES}test_pld_theta_follows_the_paper_at_every_step"),
    *_compression(),
    *_done("eigenvalue", {
        "enabled": "estimate the top Hessian eigenvalue per block", "verbose": "log the estimates",
        "max_iter": "power-iteration steps", "tol": "convergence tolerance", "stability": "added to the "
        "denominator", "gas_boundary_resolution": "estimate every this many steps", "layer_name": "the blocks' "
        "module name", "layer_num": "number of blocks"},
        f"{ENGINE}test_eigenvalues_stretch_the_moq_period", f"{ENGINE}test_eigenvalue_iteration_settings_change_the_estimate",
        f"{ENGINE}test_eigenvalue_resolution_layers_and_verbose"),
    *_quantize_training(),
    *_done("pipeline", {"stages": "pipeline stages (must agree with a PipelineModule)",
                        "partition": "how layers are split over stages"},
           f"{PIPE}test_pipeline_keys_that_disagree_with_the_module_are_refused",
           f"{PIPE_RANKS}test_two_stages_on_two_ranks_match_the_plain_model_over_50_steps"),
    done("pipeline.seed_layers", "seed each layer's initialization",
         f"{PIPE}test_seed_layers_builds_the_same_weights_whatever_the_rng",
         f"{PIPE}test_pipeline_keys_that_disagree_with_the_module_are_refused", traced=False),
    done("pipeline.activation_checkpoint_interval", "layers per activation checkpoint",
         f"{PIPE}test_activation_checkpointing_recomputes_chosen_ranges_with_the_same_gradients",
         "tests/unit/pipe/test_gpt_pipe.py::test_activation_checkpointing_modes_of_a_pipelined_gpt", traced=False),
    *_done("pipeline", {"pipe_partitioned": "partition activations between stages",
                        "grad_partitioned": "partition gradients between stages"},
           f"{PIPE_RANKS}test_model_axis_splits_messages_when_partitioned"),
    *_done("pipeline", {"schedule": "1f1b, gpipe, interleaved or zero_bubble (dsrun's)",
                        "virtual_stages": "model chunks per rank with the interleaved schedule (dsrun's)"},
           f"{PIPE}test_pipeline_schedule_picks_the_schedule", f"{PIPE_RANKS}test_every_schedule_trains_the_same_model",
           f"{PIPE_RANKS}test_interleaving_cuts_the_model_into_stages_times_virtual_stages"),
    done("hybrid_engine.enabled", "DeepSpeedHybridEngine: the training engine also generates (Hugging Face's "
         "generate on its module; at ZeRO-3 the parameters gathered once per call)", f"{HE}test_generate_at_zero3_"
         "matches_the_whole_model_and_gathers_each_parameter_once", f"{HE}test_training_between_generations_equals_"
         "a_plain_zero3_engine", traced=False),
    done("hybrid_engine.max_out_tokens", "prompt + new tokens a generate may hold: the inference workspace's (a "
         "static key/value cache's) positions; more is refused", f"{HE}test_max_out_tokens_sizes_the_workspace_"
         "and_bounds_the_generation", traced=False),
    done("hybrid_engine.inference_tp_size", "generate with the gathered blocks split over groups of this many "
         "consecutive ranks (ZeRO-3 with pin_parameters only, as in DeepSpeed)", f"{HE}test_inference_tp_splits_"
         "the_blocks_and_generates_the_same_tokens", traced=False),
    done("hybrid_engine.release_inference_cache", "free the inference workspace after every generate",
         f"{HE}test_max_out_tokens_sizes_the_workspace_and_bounds_the_generation", traced=False),
    done("hybrid_engine.pin_parameters", "ZeRO-3: gather every parameter once per generate (false: each layer "
         "at every forward, through the hooks)", f"{HE}test_pin_parameters_false_gathers_each_layer_at_every_"
         "forward", traced=False),
    done("hybrid_engine.tp_gather_partition_size", "blocks gathered at once while splitting them for "
         "inference_tp_size", f"{HE}test_inference_tp_splits_the_blocks_and_generates_the_same_tokens", traced=False),
    *_done("compile", {"enabled": "torch.compile the model", "backend": "the compile backend",
                       "kwargs": "torch.compile arguments"},
           "tests/unit/runtime/test_engine_surface.py::test_the_compile_section_compiles_the_module",
           "tests/unit/runtime/test_engine_surface.py::test_the_compile_sections_backend_and_kwargs_reach_torch_compile",
           "tests/unit/zero3/test_compile_regions.py::test_stage3_compiles_each_block_with_the_hooks_outside_the_graphs"),
    *_section("nebula", NEBULA, {
        "enabled": "save checkpoints through Nebula", "load_path": "where to load from",
        "enable_nebula_load": "load through Nebula", "persistent_storage_path": "persistent storage",
        "persistent_time_interval": "seconds between persists", "num_of_version_in_retention": "versions kept"}),
    *_weight_quantization(),
]

