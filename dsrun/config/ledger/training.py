"""Ledger entries for the training core: batch, optimizer and scheduler, communication, precision, ZeRO and
offload, logging, monitors and profilers, checkpoints, autotuning, elasticity and dsrun's own keys.

``{key}`` in a proof is replaced by the entry's key: most keys are proved by one case of the parametrized
effect tests (a world of one in-process, or two ranks for what only shows between ranks).
"""
from __future__ import annotations

from .entry import NOT_IMPLEMENTED, Entry, Feature, design, done, todo

UNIT = "tests/unit/runtime/test_config_effects.py::test_key_changes_behaviour[{key}]"
PAYLOAD = "tests/integration/test_gradient_path.py::test_reduction_payload_follows_deepspeed"
REPORTING = "tests/unit/runtime/test_config_effects_reporting.py::test_key_changes_behaviour[{key}]"
RANKS = "tests/integration/test_config_effects.py::test_key_changes_behaviour[{key}]"
CONFIG = "tests/unit/config/test_support_effects.py::test_key_changes_behaviour[{key}]"
STUDY = "tests/unit/autotuning/test_study.py::"
ZEROPP = "tests/integration/test_zeropp.py::"

GRAD_ACCUM = "tests/unit/runtime/test_grad_accum_dtype.py::"
BF16_MASTER_TESTS = "tests/unit/runtime/test_bf16_master_state.py::"
BF16_MASTER = (BF16_MASTER_TESTS + "test_bf16_master_state_holds_bf16_masters_gradients_and_states",
               BF16_MASTER_TESTS + "test_bf16_master_state_trains_close_to_fp32_masters",
               BF16_MASTER_TESTS + "test_bf16_master_state_resumes_bit_exactly",
               "tests/integration/test_bf16_master_ranks.py::test_bf16_master_state_on_two_ranks")

FP16_MASTER_TESTS = "tests/unit/runtime/test_fp16_master_state.py::"
FP16_MASTER = (FP16_MASTER_TESTS + "test_fp16_master_state_halves_the_host_master_and_gradient_bytes",
               FP16_MASTER_TESTS + "test_fp16_master_state_trains_close_to_fp32_masters",
               FP16_MASTER_TESTS + "test_fp16_master_state_resumes_bit_exactly")

MICS_PARITY = "tests/integration/test_mics_hpz.py::test_mics_partitions_over_shard_groups_and_matches_zero3"
MICS_HPZ = "tests/integration/test_mics_hpz.py::test_hpz_backward_gathers_stay_in_the_secondary_group"
MICS_HPZ_RESUME = "tests/integration/test_mics_hpz.py::test_mics_and_hpz_checkpoints_resume"
APEX = Feature("it needs NVIDIA Apex on CUDA",
               "use \"bf16\": {\"enabled\": true} or \"fp16\": {\"enabled\": true} instead")
# DeepSpeed 0.19 (fp16/fused_optimizer.py step_fused_adam): the step is handed grads=, output_params=, scale= and
# grad_norms=, the signature of Apex's pre-2019 FusedAdam alone (a CUDA kernel; DeepSpeed's own FusedAdam and torch's
# optimizers take none of them)
LEGACY_FUSION = Feature("the step signature of Apex's legacy FusedAdam (CUDA), which DeepSpeed's fp16 optimizer "
                        "calls with the gradients, fp16 outputs and scale; no optimizer dsrun builds takes them",
                        "leave legacy_fusion false")
# DeepSpeed 0.19 (runtime/utils.py graph_process, bf16_optimizer.py): the bf16 stage-0 optimizer's gradient copy,
# norm and clipping captured once and replayed; CPU_Accelerator's create_graph/capture_to_graph/replay_graph are
# no-ops, so on a CPU DeepSpeed runs them on the first step only (later steps keep its cached norm buffer and
# fp32 gradients from then)
GRAPH_HARVESTING = Feature("CUDA graphs of DeepSpeed's bf16 stage-0 optimizer (gradient copy, norm, clipping "
                           "replayed from a capture; CUDA-only, DeepSpeed's own CPU path replays nothing)",
                           "leave graph_harvesting false")
ENGINE = Feature("", "leave the key at its default")


def _stage(*stages: int):
    return lambda cfg: cfg.zero_optimization.stage in stages


ENTRIES: list[Entry] = [
    # --- batch -------------------------------------------------------------------------------------------
    done("train_batch_size", "samples per optimizer step, all ranks together", UNIT),
    done("train_micro_batch_size_per_gpu", "samples per forward/backward on one rank", UNIT),
    done("gradient_accumulation_steps", "micro-steps per optimizer step", UNIT),
    done("sequence_parallel_size", "Ulysses: ranks sharing one sample's sequence (the batch counts world / it)",
         "tests/integration/test_ulysses_gpt.py::test_sequence_parallel_gpt_matches_one_process",
         "tests/unit/config/test_sequence_parallel_config.py::test_batch_counts_world_over_sequence_parallel_size",
         traced=False),
    done("data_parallel_size", "DeepSpeed's data x sequence mesh (with sequence_parallel_size; initialize's "
         "mesh_param): checked to be world / sequence_parallel_size",
         "tests/unit/config/test_sequence_parallel_config.py::test_data_parallel_size_is_the_replica_count_of_the_mesh",
         traced=False),
    # --- optimizer and scheduler ---------------------------------------------------------------------------
    done("optimizer.type", "the optimizer: a DeepSpeed name (any case) or a torch.optim class", UNIT,
         "tests/unit/runtime/test_onebit_optimizers.py::test_onebit_adam_warmup_matches_torch_adamw",
         refused_values={
             name: "MuAdam/MuAdamW/MuSGD, the mup package's optimizers (maximal update parametrization; "
                   f"no CUDA needed): {NOT_IMPLEMENTED} (use Adam/AdamW/SGD, or pass a mup optimizer object "
                   "to initialize(optimizer=...))"
             for name in ("muadam", "muadamw", "musgd")}),
    done("optimizer.params", "the optimizer's constructor arguments", UNIT),
    todo("optimizer.legacy_fusion", "DeepSpeed's legacy fused fp16 optimizer path (CUDA)", LEGACY_FUSION,
         applies=lambda cfg: cfg.fp16.enabled),
    done("scheduler.type", "the learning-rate schedule: a DeepSpeed schedule or a torch.optim.lr_scheduler class",
         UNIT),
    done("scheduler.params", "the schedule's constructor arguments", UNIT),
    # --- communication ---------------------------------------------------------------------------------------
    done("communication_data_type", "dtype of the gradient reduction (null: the model's dtype)", RANKS),
    done("seq_parallel_comm_data_type", "with sequence_parallel_size > 1: the dtype gradients are reduced in "
         "(replaces communication_data_type, as DeepSpeed's engine does)",
         "tests/integration/test_seq_parallel_comm_dtype.py::"
         "test_seq_parallel_comm_data_type_sets_the_gradient_reduction_dtype", traced=False),
    done("prescale_gradients", "divide gradients by the world size before the reduction (off: by "
         "gradient_predivide_factor before, the rest after), as DeepSpeed", PAYLOAD),
    done("gradient_predivide_factor", "with prescale_gradients off: the divisor applied before the reduction (a "
         "reduce-scatter: times the world size), the rest of the average after", PAYLOAD),
    done("sparse_gradients", "at ZeRO stage 0 (where DeepSpeed reads it): reduce every embedding's gradient as "
         "DeepSpeed's sparse all-reduce, only the rows holding values",
         "tests/integration/test_config_effects_ranks.py::test_sparse_gradients_reduce_embedding_rows_and_train_the_"
         "same"),
    design("disable_allgather", "skip the parameter all-gather after the step (DeepSpeed internal)",
           "DeepSpeed parses it into DeepSpeedConfig.disable_allgather and reads it nowhere (no engine getter, no "
           "optimizer argument; checked in its tree of 2026-08-22), so it changes nothing in DeepSpeed either"),
    # --- precision -------------------------------------------------------------------------------------------
    done("fp16.enabled", "train in float16 with fp32 master weights and a loss scale", UNIT),
    done("fp16.auto_cast", "cast floating-point inputs to float16 before the forward", UNIT),
    done("fp16.loss_scale", "a static loss scale (0: dynamic)", UNIT),
    done("fp16.initial_scale_power", "the dynamic loss scale starts at 2**this", UNIT),
    done("fp16.loss_scale_window", "clean steps before the dynamic scale doubles", UNIT),
    done("fp16.hysteresis", "overflows absorbed before the scale halves", UNIT),
    done("fp16.consecutive_hysteresis", "refill the hysteresis on every clean step", UNIT),
    done("fp16.min_loss_scale", "the dynamic loss scale never goes below this", UNIT),
    done("fp16.fp16_master_weights_and_grads", "with fp16 enabled: fp16 master weights and master gradients in host "
         "memory, Adam's moments fp32 (DeepSpeed's ZeRO 1-3 with CPU optimizer offload and its CPU Adam, which it "
         "requires; other combinations refused)", *FP16_MASTER),
    done("bf16.enabled", "train in bfloat16 with fp32 master weights", UNIT),
    # DeepSpeed reads it only in its BF16_Optimizer (ZeRO-1, a bf16 model accumulating in fp32); the other stages
    # add each gradient where it accumulates from its hook whatever it says (a config note says so)
    done("bf16.immediate_grad_update", "ZeRO 1 with data_types.grad_accum_dtype fp32: add each bf16 gradient into "
         "the fp32 accumulator from its parameter's hook (false: all of them once backward is over)",
         GRAD_ACCUM + "test_immediate_grad_update_adds_each_gradient_as_its_hook_fires",
         GRAD_ACCUM + "test_stage1_fp32_accumulation_of_bf16_gradients_equals_the_reference"),
    done("bf16.bf16_master_weights_and_grads", "ZeRO 1-3: master weights and gradients in bf16, no fp32 copy "
         "(with bf16_optimizer_states, on the device; docs/precision.md)", *BF16_MASTER),
    done("bf16.bf16_optimizer_states", "ZeRO 1-3, with bf16_master_weights_and_grads: the optimizer's states "
         "(Adam's exp_avg, exp_avg_sq) in bf16", *BF16_MASTER),
    todo("amp.enabled", "Apex automatic mixed precision", APEX),
    done("data_types.grad_accum_dtype", "dtype gradients accumulate in over micro-steps: ZeRO 1 a whole "
         "accumulator of it, ZeRO 2-3 the partition accumulators in it (unset: the model's dtype at stages 0-1, the "
         "masters' at 2-3; stage 0 takes only the model's, as DeepSpeed; docs/precision.md)",
         GRAD_ACCUM + "test_stage1_fp32_accumulation_of_bf16_gradients_equals_the_reference",
         GRAD_ACCUM + "test_stages_2_3_accumulate_in_bf16_as_the_reference_and_hold_half_the_gradient_bytes",
         GRAD_ACCUM + "test_grad_accum_dtype_is_refused_where_deepspeed_or_dsrun_cannot_run_it",
         "tests/integration/test_grad_accum_dtype_ranks.py::test_grad_accum_dtype_on_two_ranks_equals_the_reference"),
    done("gradient_clipping", "clip the global gradient norm to this value (0: off)", UNIT),
    # --- ZeRO ------------------------------------------------------------------------------------------------
    done("zero_optimization.stage", "0: data parallel; 1: optimizer states, 2: + gradients, 3: + parameters "
         "partitioned", UNIT),
    design("zero_optimization.allgather_partitions", "all-gather the updated partitions (false: broadcasts)",
           "dsrun always all-gathers the updated partitions; DeepSpeed's alternative (one broadcast per rank) "
           "gives the same weights, so there is nothing to switch"),
    done("zero_optimization.allgather_bucket_size", "elements per all-gather of updated partitions (stages 1-2)",
         RANKS),
    done("zero_optimization.overlap_comm", "reduce gradient buckets asynchronously during backward", RANKS),
    done("zero_optimization.reduce_scatter", "reduce gradients with reduce-scatter (false: all-reduce)", RANKS,
         traced=False),  # read only between two ranks or more (a world of one copies its gradients)
    done("zero_optimization.reduce_bucket_size", "elements per gradient reduction", RANKS),
    done("zero_optimization.use_multi_rank_bucket_allreduce", "stages 1-2: false reduces each rank's piece of a "
         "bucket to that rank alone (one reduce per owner, DeepSpeed's older single-rank path) instead of one "
         "reduce-scatter; the same partitions", "tests/integration/test_config_effects_ranks.py::"
         "test_use_multi_rank_bucket_allreduce_false_reduces_each_piece_to_its_owner",
         traced=False),  # read only between two ranks or more (a world of one copies its gradients)
    design("zero_optimization.contiguous_gradients", "copy gradients into one contiguous buffer as they are "
           "produced", "dsrun keeps every gradient in flat contiguous buffers at every stage; the key exists in "
           "DeepSpeed to avoid memory fragmentation its non-contiguous path has, which dsrun does not have"),
    done("zero_optimization.load_from_fp32_weights", "on load, take the fp32 master weights from the "
         "checkpoint (false: rebuild them from the 16-bit weights; stages 1-3)",
         "tests/unit/checkpoint/test_engine_checkpoint.py::test_load_from_fp32_weights_false_rebuilds_the_masters_"
         "from_the_16bit_weights"),
    design("zero_optimization.grad_hooks", "documented for stage 1", "DeepSpeed itself does not read it (its "
           "ZeRO config model has no such field), so it changes nothing in DeepSpeed either"),
    done("zero_optimization.round_robin_gradients", "stages 1-2: lay each flat group out round-robin over the "
         "ranks, so consecutive gradients land in different ranks' partitions (the same training, another layout)",
         "tests/integration/test_config_effects_ranks.py::test_round_robin_gradients_reorders_the_layout_and_"
         "trains_the_same"),
    done("zero_optimization.elastic_checkpoint", "stages 1-2: save the optimizer state in DeepSpeed's elastic "
         "layout (per param group, without the partition's padding, the step beside it; false: each rank's torch "
         "optimizer state dict); either layout loads at any world size",
         "tests/unit/checkpoint/test_engine_checkpoint.py::test_elastic_checkpoint_switches_the_optimizer_layout_"
         "and_either_resumes_bit_exactly",
         "tests/integration/test_checkpoint_reshard.py::test_elastic_checkpoint_continues_on_another_world_size"),
    done("zero_optimization.ignore_unused_parameters", "false: at ZeRO stages 1-2 (where DeepSpeed reads it) a "
         "step in which a trainable parameter got no gradient fails on every rank, with DeepSpeed's message", UNIT),
    todo("zero_optimization.legacy_stage1", "DeepSpeed's old stage-1 implementation",
         Feature("DeepSpeed's stage 1 from before 0.5.8, which DeepSpeed 0.19 refuses too", "leave legacy_stage1 "
                 "false"), applies=_stage(1)),
    done("zero_optimization.sub_group_size", "elements per optimizer sub-group (stage 3, offload)", UNIT),
    done("zero_optimization.offload_param.device", "where stage-3 parameter shards live: none, cpu or nvme",
         UNIT),
    done("zero_optimization.offload_param.nvme_path", "folder of the parameter swap files", UNIT),
    done("zero_optimization.offload_param.pin_memory", "page-locked host buffers (with an accelerator)", UNIT),
    done("zero_optimization.offload_param.buffer_count", "host buffers for NVMe parameter swapping", UNIT),
    done("zero_optimization.offload_param.buffer_size", "elements per NVMe parameter swap buffer", UNIT),
    done("zero_optimization.offload_param.max_in_cpu", "parameter elements kept in host memory with NVMe", UNIT),
    done("zero_optimization.offload_optimizer.device", "where master weights and optimizer states live: none, "
         "cpu or nvme", UNIT),
    done("zero_optimization.offload_optimizer.nvme_path", "folder of the optimizer swap files", UNIT),
    done("zero_optimization.offload_optimizer.pin_memory", "page-locked host buffers (with an accelerator)",
         UNIT),
    done("zero_optimization.offload_optimizer.ratio", "fraction of the optimizer offloaded (stage 3)", UNIT),
    done("zero_optimization.offload_optimizer.buffer_count", "host buffers for NVMe optimizer swapping", UNIT),
    done("zero_optimization.offload_optimizer.fast_init", "skip writing zero optimizer states to NVMe at start",
         UNIT),
    design("zero_optimization.offload_optimizer.pipeline_read", "overlap NVMe reads with the optimizer step",
           "dsrun's offloaded step always overlaps reads and writes with compute (a fetch-ahead, store-behind "
           "pipeline); the results do not depend on it"),
    design("zero_optimization.offload_optimizer.pipeline_write", "overlap NVMe writes with the optimizer step",
           "dsrun's offloaded step always overlaps reads and writes with compute (a fetch-ahead, store-behind "
           "pipeline); the results do not depend on it"),
    done("zero_optimization.stage3_max_live_parameters", "most parameter elements gathered at once (stage 3)",
         UNIT),
    done("zero_optimization.stage3_max_reuse_distance", "keep a parameter gathered if it is used again within "
         "this many elements (stage 3)", UNIT),
    done("zero_optimization.stage3_prefetch_bucket_size", "elements gathered ahead of use (stage 3)", UNIT),
    done("zero_optimization.stage3_param_persistence_threshold", "parameters smaller than this stay gathered "
         "(stage 3)", UNIT),
    done("zero_optimization.stage3_model_persistence_threshold", "most elements kept persistent in total "
         "(stage 3)", UNIT),
    done("zero_optimization.stage3_gather_16bit_weights_on_model_save", "save_16bit_model gathers the full "
         "model (stage 3)", UNIT),
    done("zero_optimization.stage3_use_all_reduce_for_fetch_params", "stage 3: a fetch's parameters gathered by "
         "one all-reduce of a zeroed flat buffer holding this rank's shards at their offsets (not for hpZ's "
         "secondary or quantized gathers)", RANKS),
    done("zero_optimization.stage3_module_granularity_threshold", "ZeRO-3 gathers whole (as leaf modules) the "
         "outermost modules with at most this many parameter elements per layer (0: off)",
         "tests/unit/zero3/test_leaf_modules.py::test_stage3_module_granularity_threshold_makes_leaves_through_"
         "the_config", "tests/unit/zero3/test_leaf_modules.py::test_granularity_threshold_flags_the_outermost_"
         "small_modules"),
    done("zero_optimization.zero_hpz_partition_size", "hpZ: ranks of the secondary parameter partition that "
         "backward gathers from (stage 3; 1: off)", MICS_HPZ, MICS_HPZ_RESUME),
    done("zero_optimization.zero_quantized_weights", "qwZ: stage-3 parameter all-gathers carry INT8 blocks "
         "with per-block scales", ZEROPP + "test_quantized_weights_gather_int8_blocks"),
    done("zero_optimization.zero_quantized_nontrainable_weights", "frozen parameters' stage-3 shards kept as INT8 "
         "blocks + fp32 scales (about 1/4 of fp32), gathered as stored and dequantized",
         ZEROPP + "test_nontrainable_weights_kept_int8", ZEROPP + "test_nontrainable_weights_gather_quantized",
         ZEROPP + "test_nontrainable_weights_resume_exactly"),
    done("zero_optimization.zero_quantized_gradients", "qgZ: the stage-3 gradient reduce-scatter is a "
         "hierarchical INT4 all-to-all", ZEROPP + "test_quantized_gradients_int4_all_to_all"),
    done("zero_optimization.zeropp_loco_param", "LoCo: qgZ's quantization error carried to the bucket's next "
         "step ({err_beta, reset_T}; needs zero_quantized_gradients)", ZEROPP + "test_loco_feeds_the_quantization_error_back",
         ZEROPP + "test_collectives_equal_the_plain_torch_simulation",
         ZEROPP + "test_hierarchical_reduce_scatter_on_two_nodes_of_two"),
    done("zero_optimization.mics_shard_size", "MiCS: ranks per shard group, replicated across groups (stage 3; "
         "-1: off)", MICS_PARITY, MICS_HPZ_RESUME),
    done("zero_optimization.mics_hierarchical_params_gather", "MiCS: gather inside each node, then across nodes",
         MICS_PARITY),
    done("zero_optimization.memory_efficient_linear", "stage-3 linear layers do not keep the gathered weight "
         "for backward", UNIT),
    done("zero_optimization.pipeline_loading_checkpoint", "ZeRO-3: a node's ranks restore their optimizer state "
         "one after another (DeepSpeed's serial load; not pipeline parallelism)",
         "tests/integration/test_config_effects_ranks.py::"
         "test_pipeline_loading_checkpoint_restores_one_local_rank_at_a_time"),
    done("zero_optimization.override_module_apply", "inside zero.Init (given this config), module.apply(fn) "
         "gathers each module's partitioned parameters around fn and keeps rank 0's result (DeepSpeed's default); "
         "false: fn sees them partitioned, and what it writes through .data is lost, as in DeepSpeed",
         "tests/integration/test_zero3_api.py::test_module_apply_inside_zero_init_follows_override_module_apply",
         traced=False),
    done("zero_optimization.log_trace_cache_warnings", "log when a pass leaves the stage-3 prefetch trace "
         "(DeepSpeed's \"Invalidate trace cache\" line)", "tests/unit/zero3/test_leaf_modules.py::"
         "test_log_trace_cache_warnings_says_when_a_pass_leaves_the_recorded_order"),
    done("zero_allow_untested_optimizer", "allow ZeRO with an optimizer outside Adam/AdamW/Lamb/Adagrad/Lion",
         UNIT),
    done("zero_force_ds_cpu_optimizer", "optimizer offload requires a DeepSpeed CPU optimizer", UNIT),
    done("aio.block_size", "bytes per NVMe I/O request", UNIT),
    done("aio.queue_depth", "NVMe requests in flight", UNIT),
    done("aio.thread_count", "I/O threads per request", UNIT),
    done("aio.single_submit", "submit requests one by one", UNIT),
    done("aio.overlap_events", "overlap request submission and completion", UNIT),
    # --- logging ---------------------------------------------------------------------------------------------
    done("steps_per_print", "optimizer steps between progress lines (null: no progress line; wall-clock means "
         "every step)", REPORTING),
    done("wall_clock_breakdown", "time forward, backward and step and report the means", REPORTING),
    done("dump_state", "log every attribute of the engine once it is built (rank 0)", REPORTING),
    done("memory_breakdown", "log device and host memory once the engine is built and before and after every "
         "forward, backward and step (rank 0)", REPORTING),
    # --- monitors --------------------------------------------------------------------------------------------
    done("tensorboard.enabled", "write TensorBoard events", REPORTING),
    done("tensorboard.output_path", "folder of the TensorBoard events (empty: the run directory)", REPORTING),
    done("tensorboard.job_name", "sub-folder of the TensorBoard events", REPORTING),
    done("wandb.enabled", "log to Weights & Biases", REPORTING),
    done("wandb.group", "W&B group", REPORTING),
    done("wandb.team", "W&B entity", REPORTING),
    done("wandb.project", "W&B project", REPORTING),
    done("comet.enabled", "log to Comet", REPORTING),
    done("comet.samples_log_interval", "log an event each time global samples cross a multiple of this", REPORTING),
    done("comet.project", "Comet project", REPORTING),
    done("comet.workspace", "Comet workspace", REPORTING),
    done("comet.api_key", "Comet API key", REPORTING),
    done("comet.experiment_name", "Comet experiment name", REPORTING),
    done("comet.experiment_key", "the key of the Comet experiment to create or continue", REPORTING),
    done("comet.online", "false: log offline", REPORTING),
    done("comet.mode", "get, create or get_or_create the experiment", REPORTING),
    done("csv_monitor.enabled", "write one CSV file per metric", REPORTING),
    done("csv_monitor.output_path", "folder of the CSV files (empty: the run directory)", REPORTING),
    done("csv_monitor.job_name", "sub-folder of the CSV files", REPORTING),
    done("mlflow.enabled", "log to MLflow (dsrun's own section)", REPORTING),
    done("mlflow.tracking_uri", "the MLflow tracking URI (null: ./mlruns)", REPORTING),
    done("mlflow.experiment_name", "the MLflow experiment", REPORTING),
    done("mlflow.run_name", "the MLflow run name", REPORTING),
    done("mlflow.log_artifacts", "also log the run directory's files", REPORTING),
    done("comms_logger.enabled", "record every collective (count, bytes, latency)", REPORTING),
    done("comms_logger.verbose", "print every collective as it happens", REPORTING),
    done("comms_logger.prof_all", "profile every collective (false: only prof_ops)", REPORTING),
    done("comms_logger.debug", "record the calling function of each collective", REPORTING),
    done("comms_logger.prof_ops", "collectives to profile when prof_all is false", REPORTING),
    done("flops_profiler.enabled", "profile one training step", REPORTING),
    done("flops_profiler.recompute_fwd_factor", "count this fraction of the forward again (recomputation)",
         REPORTING),
    done("flops_profiler.profile_step", "the optimizer step to profile", REPORTING),
    done("flops_profiler.module_depth", "depth of the per-module report (-1: all)", REPORTING),
    done("flops_profiler.top_modules", "modules listed in the report's top lists", REPORTING),
    done("flops_profiler.detailed", "print the per-module tree", REPORTING),
    done("flops_profiler.output_file", "write the report to this file (null: stdout)", REPORTING),
    # --- checkpoints -------------------------------------------------------------------------------------------
    done("checkpoint.tag_validation", "Ignore, Warn or Fail when ranks save under different tags",
         "tests/integration/test_checkpoint_tags.py::test_save_failures"),
    done("checkpoint.load_universal", "load a checkpoint through the resharding path",
         "tests/unit/checkpoint/test_engine_checkpoint.py::test_load_universal_goes_through_the_reshard_path"),
    done("checkpoint.use_node_local_storage", "each node's local rank 0 prepares, writes the model states of and "
         "commits the checkpoint in its node's own save_dir: every node's storage holds a whole checkpoint",
         "tests/integration/test_config_effects_ranks.py::test_use_node_local_storage_gives_every_node_a_whole_"
         "checkpoint"),
    done("checkpoint.parallel_write.pipeline_stage", "a pipeline stage's data-parallel ranks share its layer files",
         "tests/integration/test_pipe.py::test_parallel_write_spreads_layer_files_over_data_parallel_ranks",
         traced=False),  # read by the pipeline engine's checkpoint (the tracer's runs have no PipelineModule)
    # --- autotuning (read by dsrun tune) -------------------------------------------------------------------
    done("autotuning.enabled", "the config may be tuned by dsrun tune (false: dsrun tune refuses it)", CONFIG,
         traced=False),
    done("autotuning.fast", "tune only the ZeRO stage and the micro batch size", CONFIG),
    done("autotuning.results_dir", "folder of the tuning results", CONFIG),
    done("autotuning.exps_dir", "folder of the trial experiments", CONFIG),
    done("autotuning.overwrite", "start a fresh study instead of resuming (dsrun resumes unless it is set)",
         CONFIG, STUDY + "test_a_different_space_in_the_same_results_dir_is_refused_unless_overwrite",
         traced=False),
    done("autotuning.metric", "latency, throughput or flops", CONFIG),
    done("autotuning.metric_path", "the engine writes the profile window's step timings here after "
         "end_profile_step and exits (an autotuning experiment of dsrun launch --autotuning)",
         "tests/integration/test_launch_autotuning.py::test_autotuning_run_tunes_the_script_then_trains_the_best"),
    done("autotuning.start_profile_step", "first step of the measured window", CONFIG),
    done("autotuning.end_profile_step", "last step of the measured window", CONFIG),
    done("autotuning.max_train_batch_size", "largest global batch a trial may use", CONFIG),
    done("autotuning.min_train_batch_size", "smallest global batch a trial may use (a smaller one is pruned "
         "before launch)", CONFIG),
    done("autotuning.max_train_micro_batch_size_per_gpu", "largest micro batch tried", CONFIG),
    done("autotuning.min_train_micro_batch_size_per_gpu", "smallest micro batch tried", CONFIG),
    done("autotuning.num_tuning_micro_batch_sizes", "how many micro batch sizes are tried", CONFIG),
    done("autotuning.mp_size", "model-parallel size of the tuned job: trials' data-parallel size (global batch, "
         "micro-batch bound) is ranks / mp_size; a recipe must train with that AutoTP size (tensor_parallel."
         "autotp_size), whose split the memory pruning counts", CONFIG),
    done("autotuning.tuner_type", "gridsearch, random or model_based",
         STUDY + "test_grid_search_decides_every_configuration_once",
         STUDY + "test_model_based_never_launches_a_configuration_twice"),
    done("autotuning.tuner_early_stopping", "stop after this many trials without improvement",
         STUDY + "test_early_stopping_after_trials_without_improvement"),
    done("autotuning.tuner_num_trials", "most trials", STUDY + "test_model_based_never_launches_a_configuration_twice"),
    done("autotuning.arg_mappings", "map DeepSpeed keys to the script's own arguments", CONFIG),
    done("autotuning.model_info.profile", "with autotuning.enabled: the engine only profiles the model (parameter "
         "counts, the first forward's activation bytes) into model_info_path, then exits", REPORTING),
    done("autotuning.model_info.num_params", "the model's parameter count (skips the profiling run)", CONFIG),
    *[design(f"autotuning.model_info.{key}", meaning, "DeepSpeed's tuner uses it to estimate activation memory; "
             "dsrun tune estimates activations from the model itself (dsrun.estimate), so the value is only "
             "recorded with the model facts") for key, meaning in (("hidden_size", "the model's hidden size"),
                                                                    ("num_layers", "the model's layer count"))],
    done("autotuning.model_info_path", "where model_info.profile writes the model facts (default "
         "./autotuning_model_info.json)", REPORTING),
    # --- elasticity (resolved by the config layer's batch arithmetic) --------------------------------------------
    *[done(f"elasticity.{key}", meaning, CONFIG, traced=False) for key, meaning in (
        ("enabled", "compute the batch sizes from the elastic search"),
        ("max_train_batch_size", "the largest global batch the search may pick"),
        ("micro_batch_sizes", "micro batch sizes the search may pick"),
        ("min_gpus", "smallest GPU count the batch must suit"),
        ("max_gpus", "largest GPU count the batch must suit"),
        ("prefer_larger_batch", "break ties toward the larger batch"),
        ("version", "the search algorithm, 0.1 or 0.2"),
        ("ignore_non_elastic_batch_info", "allow the top-level batch keys next to elasticity"),
        ("num_gpus_per_node", "GPUs per node (version 0.2)"),
        ("model_parallel_size", "model-parallel size (version 0.2)"))],
    design("elasticity.min_time", "minimum minutes between rescaling (version 0.1)",
           "read by an elastic scheduler outside DeepSpeed; DeepSpeed's batch search does not use it either"),
    # --- dsrun's own ---------------------------------------------------------------------------------------
    done("dsrun_allow_unimplemented", "turn the refusal of not-implemented keys into one warning line per key",
         CONFIG, traced=False),
    # --- odds and ends ---------------------------------------------------------------------------------------
    design("timers.throughput.enabled", "DeepSpeed's throughput timer", "dsrun has no separate throughput "
           "timer: samples/s and tokens/s come from dsrun train's loop and the monitors, so there is nothing "
           "to turn off"),
    design("timers.throughput.synchronized", "synchronize the device before timing", "dsrun has no separate "
           "throughput timer (see timers.throughput.enabled)"),
    done("dataloader_drop_last", "drop the last incomplete micro-batch of training_data's loader", UNIT),
    done("vocabulary_size", "the model's vocabulary size: a size that is not a multiple of 8 gets DeepSpeed's "
         "warning (GPU tensor cores), the one thing DeepSpeed does with it", CONFIG, traced=False),
    todo("graph_harvesting", "capture the step as a CUDA graph", GRAPH_HARVESTING),
    done("use_data_before_expert_parallelism", "lay MoE expert groups out data-parallel first",
         "tests/unit/moe/test_engine_moe.py::test_use_data_before_expert_parallelism_sets_the_expert_layout",
         traced=False),  # read when the engine attaches MoE layers (the tracer's model has none)
]
