"""Ledger entries for the keys DeepSpeed added between 0.14 and 0.19 (dsrun/config/recent.py and the new
fields of the older sections). ``torch_autocast``, ``gradient_allreduce_op``, ``log_level``,
``disable_python_gc``, ``managed_gradient_accumulation``, the ZeRO-3 ``leaf_module`` section,
``checkpoint.checkpoint_serialization`` and the checkpoint writers (``checkpoint.writer.type``, its buffer keys
and ``decoupled``) act; the rest are refused when a config enables them, each with the reason its feature names.
"""
from __future__ import annotations

from .entry import Entry, Feature, done, todo

AUTOCAST = "tests/unit/runtime/test_torch_autocast.py::"
REPORTING = "tests/unit/runtime/test_config_effects_reporting.py::test_key_changes_behaviour[{key}]"
ZF = "tests/unit/offload/test_zenflow.py::"
ZENFLOW_KEYS = (  # (key, meaning, proofs in ZF)
    ("topk_ratio", "share of each matrix's gradient columns (by |gradient| summed over rows) updated every step",
     ("test_topk_one_and_update_interval_one_equal_plain_offload", "test_topk_ratio_picks_the_heaviest_columns")),
    ("select_strategy", "re-select the columns every select_interval steps (step) or epochs (epoch, auto)",
     ("test_select_interval_and_epochs_reselect_the_columns",)),
    ("select_interval", "steps (or epochs) between column selections",
     ("test_select_interval_and_epochs_reselect_the_columns",)),
    ("update_interval", "steps between the CPU optimizer's updates of the other columns (auto: when caught up)",
     ("test_no_update_is_staler_than_update_interval", "test_auto_update_interval_closes_windows_by_the_ratio")),
    ("overlap_step", "run the CPU update in the background during the next forward/backward",
     ("test_no_update_is_staler_than_update_interval",)),
    ("offload", "the selected columns' optimizer state in host memory (the estimator counts it there)",
     ("test_the_estimate_counts_zenflow_state_where_offload_puts_it",)),
    ("auto_ratio", "share of matrices that must have caught up before an auto update",
     ("test_auto_update_interval_closes_windows_by_the_ratio",)),
    ("full_warm_up_rounds", "steps of plain offload before selection starts",
     ("test_warm_up_rounds_step_like_plain_offload",)),
    ("pt_reserved_cores_perc", "share of the cores kept for training; the overlapped CPU update runs on the rest",
     ("test_the_optimizer_thread_runs_on_its_share_of_the_cores",)),
    ("steps_per_epoch", "optimizer steps per epoch for epoch selection (else the data loader's length)",
     ("test_select_interval_and_epochs_reselect_the_columns",)),
)
WRITERS = "tests/unit/checkpoint/test_writer_checkpoint.py::"
# DeepSpeed 0.19.8 (model_checkpointing/writer_factory.py, io/fast_file_writer.py): with data_parallel set, each
# data-parallel writer of a stage 0-2 file writes <file>-<dp rank>.<dp size x io_multiplier> and never <file>; its
# byte split (_save_storage_list) runs only under a torch that calls save_torch_storage_object_list (stock torch
# never does: each rank then writes the whole file to its own name), and FastCheckpointEngine.load reads <file>, so
# no loader reads what it writes. dsrun's own loadable split (each rank its byte range of <file>) is not built yet
SPLIT = Feature("DeepSpeed's data-parallel split of checkpoint writes (part files no loader reads, DeepSpeed's "
                "included)", "remove checkpoint.writer.data_parallel and io_multiplier")
AUTOTP_TESTS = "tests/integration/test_autotp_training.py::"
AUTOTP_UNIT = "tests/unit/tensor_parallel/test_autotp_split.py::"
DC = "tests/unit/compile/test_deepcompile.py::"
TP_COMPILE = "tests/unit/tensor_parallel/test_compile_pass.py::"
GRAPH_EDITS = "tests/unit/compile/test_graph_edits.py::"
SWAP = "tests/unit/offload/test_swap_traffic.py::"
LEAF_PROOF = "tests/unit/zero3/test_leaf_modules.py::test_the_config_leaf_module_section_flags_leaves_at_stage_3"
DTYPES_TESTS = "tests/unit/runtime/test_data_types.py::"


def _section(prefix: str, feature: Feature, keys: dict[str, str], **kwargs) -> list[Entry]:
    return [todo(f"{prefix}.{key}", meaning, feature, **kwargs) for key, meaning in keys.items()]


ENTRIES: list[Entry] = [
    done("torch_autocast.enabled", "run the forward under torch.autocast (parameters stay fp32)",
         f"{AUTOCAST}test_torch_autocast_runs_linear_layers_in_bf16"),
    done("torch_autocast.dtype", "the autocast dtype (null: bfloat16 on CPU)",
         f"{AUTOCAST}test_torch_autocast_dtype_and_safe_modules"),
    done("torch_autocast.lower_precision_safe_modules", "modules whose gradients are reduced in the autocast "
         "dtype (their parameters get comm_dtype)", f"{AUTOCAST}test_torch_autocast_dtype_and_safe_modules"),
    done("gradient_allreduce_op", "sum (\"sum\") instead of average (\"mean\") the gradients over ranks",
         "tests/integration/test_config_effects.py::test_key_changes_behaviour[gradient_allreduce_op]"),
    done("log_level", "the level of the \"DeepSpeed\" logger and its handlers, set when an engine is built",
         REPORTING),
    done("managed_gradient_accumulation", "false: the caller owns the accumulation boundary: backward only "
         "accumulates (stages 0-1) and every step() reduces and updates; global_samples counts the backwards run",
         "tests/unit/runtime/test_config_effects.py::test_key_changes_behaviour[{key}]"),
    done("disable_python_gc", "automatic cyclic GC off while an engine lives (one collection first; "
         "engine.collect_python_gc() collects at a step the script picks)", REPORTING),
    done("expert_parallel", "AutoEP: a Hugging Face MoE model's expert blocks become expert-parallel layers "
         "(docs/moe.md lists the section's keys; load_balance_coeff, expert_tensor_parallel_size > 1 and folding "
         "over tensor_parallel.autotp_size > 1 are refused)",
         "tests/unit/moe/test_autoep.py::test_engine_replaces_blocks_and_trains",
         "tests/unit/moe/test_autoep.py::test_config_refusals"),
    # DeepSpeed 0.19 (checkpoint_engine/datastates_checkpoint_engine.py) imports datastates.CheckpointEngine and
    # raises "Please install DataStates" without it; the library is built from its GitHub repository (not on PyPI)
    todo("datastates_ckpt", "DataStates asynchronous checkpointing", Feature(
        "DataStates-LLM's checkpoint engine (the separate datastates library, built from github.com/DataStates/"
        "datastates-llm; DeepSpeed refuses the key without it too)", "remove datastates_ckpt; "
        "checkpoint.writer.decoupled saves in the background"),
         active=lambda cfg: cfg.datastates_ckpt not in (None, False)),
    done("bf16.check_grad_overflow", "at ZeRO stages 1-2 (where DeepSpeed 0.19 checks): skip a bf16 step whose "
         "gradients hold inf/nan", "tests/unit/runtime/test_config_effects.py::test_key_changes_behaviour[{key}]"),
    done("data_types.param_dtype", "the model parameters' dtype: must name the one fp16/bf16 gives them (a "
         "conflict is refused, as DeepSpeed asserts)", f"{DTYPES_TESTS}test_param_dtype_must_match_the_precision",
         traced=False),  # checked by the config layer, which the tracer does not count
    done("data_types.buffer_dtype", "with fp16/bf16: cast every floating-point buffer to this dtype after the "
         "model's cast (null: buffers take the model's dtype)", f"{DTYPES_TESTS}test_buffer_dtype_casts_the_buffers"),
    # not a DeepSpeed key (0.19's data_types has grad_accum_dtype, param_dtype and buffer_dtype only): Hugging Face's
    # _keep_in_fp32_modules, matched as transformers matches it (dsrun/precision/keep_fp32.py)
    done("data_types.keep_in_fp32_modules", "with fp16/bf16: the parameters and buffers whose names match an entry "
         "(Hugging Face's rule) stay fp32 through the model's cast and the ZeRO stages' copies; \"auto\": the "
         "model's own _keep_in_fp32_modules(_strict), as Hugging Face applies them; a listed module wholly fp32 "
         "computes in fp32 and returns its caller's dtype",
         f"{DTYPES_TESTS}test_keep_in_fp32_modules_keeps_the_listed_modules_fp32",
         "tests/integration/test_keep_in_fp32_modules.py::test_kept_modules_train_fp32_at_zero_stages",
         "tests/integration/test_keep_in_fp32_features.py::test_kept_modules_train_fp32_beside_the_feature",
         f"{DTYPES_TESTS}test_keep_in_fp32_modules_beside_torch_autocast_is_refused"),
    todo("aio.use_gds", "NVIDIA GPUDirect Storage for NVMe I/O", Feature("GPUDirect Storage (CUDA)",
                                                                        "leave use_gds false")),
    done("hybrid_engine.enable_cuda_graph", "replay the decode steps of a generate from CUDA graphs; refused with "
         "the reason where they cannot run (a CPU, ZeRO-3, release_inference_cache, inference_tp_size > 1)",
         "tests/unit/runtime/test_hybrid_engine_settings.py::test_enable_cuda_graph_is_refused_with_the_reason",
         traced=False),
    done("checkpoint.checkpoint_serialization", "false: every checkpoint file in torch.save's legacy (pre-zipfile) "
         "format", "tests/unit/checkpoint/test_engine_checkpoint.py::test_checkpoint_serialization_false_writes_the_"
         "legacy_format_and_resumes"),
    # the writers every checkpoint file goes through (dsrun/io, dsrun.checkpoint.atomic.save_torch)
    done("checkpoint.writer.type", "the writer of every checkpoint file: FAST (O_DIRECT, aligned buffers through "
         "async I/O, the records' CRC32s computed off the saving thread), PYTHON (buffered file) or MOCK (counts "
         "bytes, writes empty files)",
         f"{WRITERS}test_a_checkpoint_written_by_the_fast_writer_resumes_bit_exactly",
         f"{WRITERS}test_each_writer_type_writes_its_way"),
    done("checkpoint.writer.io_buffer_size", "bytes of the fast writer's I/O buffer (each O_DIRECT write is a half "
         "of it, or all of it single-buffered)", f"{WRITERS}test_buffer_size_and_double_buffering_shape_the_writes"),
    done("checkpoint.writer.io_buffer_double", "fill one half of the buffer while the other is written",
         f"{WRITERS}test_buffer_size_and_double_buffering_shape_the_writes"),
    done("checkpoint.writer.show_statistics", "log each file's write statistics",
         f"{WRITERS}test_each_writer_type_writes_its_way"),
    # decoupled acts (dsrun/checkpoint/decoupled.py); the fast writers' own keys wait for those writers
    done("checkpoint.writer.decoupled", "save in the background: training waits only for a host-memory snapshot; "
         "the checkpoint is published once every rank's files are durable",
         "tests/integration/test_decoupled_checkpoint.py::test_a_decoupled_save_resumes_bit_exactly_while_training_"
         "goes_on"),
    *_section("checkpoint.writer", SPLIT, {"data_parallel": "which data-parallel ranks write",
                                           "io_multiplier": "I/O buffer multiplier"}),
    # ZeRO
    done("zero_optimization.compute_grad_norm", "false: no global gradient norm at stages 1-2 "
         "(get_global_grad_norm() is None); refused, as by DeepSpeed, with gradient_clipping, optimizer offload or "
         "another stage", "tests/unit/runtime/test_config_effects.py::test_key_changes_behaviour[{key}]",
         traced=False),  # the config layer's rules read it; dsrun's step measures the norm only to clip
    done("zero_optimization.stage3_allgather_sequential", "stage 3: true gathers each parameter with a collective "
         "of its own; false (DeepSpeed's default, dsrun's when unset on CUDA; unset on the CPU is true) one "
         "all-gather per fetch (a module's, a prefetch bucket's) over the concatenated shards (qwZ, MiCS "
         "hierarchical and offloaded shards gather one by one)",
         "tests/integration/test_config_effects.py::test_key_changes_behaviour[{key}]"),
    # DeepSpeed 0.19.8 (stage_1_and_2.py) reads it at stages 1-2 only, as dsrun does (dsrun/zero/layout.py)
    done("zero_optimization.parameter_alignment", "stages 1-2: zeros between the parameters of each flat buffer so "
         "each starts 16-byte aligned, counted into the partitions and saved as param_alignment_paddings as "
         "DeepSpeed does (resharding, zero_to_fp32 and DeepSpeed's files follow them); the same training",
         "tests/integration/test_config_effects_ranks.py::test_parameter_alignment_aligns_each_parameter_and_"
         "trains_the_same",
         "tests/integration/test_config_effects_ranks.py::test_parameter_alignment_checkpoint_resumes_and_"
         "reshards_to_one_rank"),
    done("zero_optimization.enable_sanity_checks", "stage 3: an in-place change inside "
         "GatheredParameters(modifier_rank=None), which the ranks would not share, raises (DeepSpeed's check)",
         "tests/unit/zero3/test_api.py::test_enable_sanity_checks_refuses_a_change_gathered_parameters_would_lose"),
    # DeepSpeed 0.19.8 reads it only for Muon at stage 3 with NVMe optimizer offload (stage3.py: the momentum of a
    # swapped sub-group is then a resident buffer, not swapped with its other states); everywhere else the momentum
    # is in memory whatever the key says, in DeepSpeed and in dsrun (dsrun/optim/muon/zero.py)
    done("zero_optimization.save_muon_momentum_buffer_in_memory", "ZeRO-3 with NVMe optimizer offload and Muon: "
         "keep Muon's momentum in memory instead of in the swap files beside the sub-group's master and gradient "
         "(the same training; the swap files hold that many bytes less)",
         "tests/integration/test_muon_zero.py::test_nvme_offload_trains_bit_exactly_like_memory_and_the_key_keeps_"
         "momentum_in_memory"),
    *[done(f"zero_optimization.leaf_module.{key}", f"ZeRO-3 gathers these modules whole, hooking nothing inside "
           f"them: {meaning} (DeepSpeed's set_z3_leaf_modules from the config)", LEAF_PROOF)
      for key, meaning in (("classes", "the modules of these classes (plain or qualified names)"),
                           ("names", "the modules of these named_modules() names"),
                           ("name_suffixes", "the modules whose names end so"))],
    # SuperOffload's overlap, for NVMe sub-groups: each stepped during backward once its gradient is final (its CPU form
    # on superchips is not built: refused with device cpu, where ZenFlow is the overlapped step)
    done("zero_optimization.offload_optimizer.super_offload", "ZeRO-3 with NVMe optimizer offload: each sub-group "
         "stepped during backward as soon as its gradient is final (state read ahead, writes drained behind, no "
         "gradient file), as SuperOffload steps its CPU sub-groups; needs gradient_clipping 0 and no fp16",
         f"{SWAP}test_super_offload_steps_during_backward_bit_identically_with_fewer_bytes"),
    done("zero_optimization.offload_optimizer.cpuadam_cores_perc", "the CPU optimizer's share of the cores: "
         "ZenFlow's overlapped step runs on a thread pinned to them, training on the rest (when set, instead of "
         "1 - zenflow.pt_reserved_cores_perc)", f"{ZF}test_the_optimizer_thread_runs_on_its_share_of_the_cores"),
    # offload is read by the estimator (dsrun estimate-memory), which the tracer's runs do not cover: a CPU run keeps
    # the selected columns' state in host memory either way
    *[done(f"zero_optimization.zenflow.{key}", meaning, *(f"{ZF}{t}" for t in tests), traced=key != "offload")
      for key, meaning, tests in ZENFLOW_KEYS],
    # AutoTP training
    done("tensor_parallel.autotp_size", "tensor-parallel degree: the model split column/row-wise over groups of "
         "that many ranks (by partition_config / preset_model, else its Hugging Face tp_plan, else its Transformer "
         "blocks read automatically; docs/autotp.md)", AUTOTP_TESTS + "test_gpt2_tp2_zero1_"
         "matches_the_unsplit_run_and_holds_half_of_each_split_matrix", AUTOTP_TESTS + "test_tp2_by_dp2_on_4_ranks"),
    done("tensor_parallel.partition_config", "DeepSpeed's layer specs: linears named by regex split column-wise, "
         "row-wise (fused parts by shape, gathered outputs by gather_output) or kept whole; unmatched linears whole; "
         "the first match wins (docs/autotp.md)", AUTOTP_TESTS + "test_partition_config_rules_split_llama_and_train_"
         "as_the_unsplit_run", AUTOTP_UNIT + "test_rules_naming_the_automatic_split_cut_the_same_slices"),
    done("tensor_parallel.preset_model", "a built-in family's layer specs (llama, qwen2, bloom, chatglm, mixtral, "
         "deepseek_v2, phi3), merged after partition_config's when it keeps use_default_specs",
         AUTOTP_UNIT + "test_rules_naming_the_automatic_split_cut_the_same_slices"),
    done("tensor_parallel.tp_overlap_comm", "the column-parallel backward starts the input gradient's all-reduce "
         "and computes the weight's gradient while it runs",
         AUTOTP_TESTS + "test_zero_stages_0_and_2_bf16_and_tp_overlap_comm_split_the_same_way"),
    done("tensor_parallel.tp.tp_grain_size", "the cut of what is not attention (MLP, LM head) in grains of that "
         "many features, as evenly as possible, the tail that fills no grain to the last rank (DeepSpeed's); "
         "attention is cut on whole heads", AUTOTP_UNIT + "test_a_fused_gqa_projection_is_cut_per_part_on_whole_"
         "heads_and_the_mlp_in_grains", AUTOTP_TESTS + "test_a_fused_gqa_model_split_per_part_and_in_grains_trains_"
         "as_the_unsplit_run"),
    done("tensor_parallel.tp.tp_size", "the tensor-parallel degree again: 1 or autotp_size, anything else refused "
         "(as DeepSpeed)", AUTOTP_UNIT + "test_a_fused_gqa_projection_is_cut_per_part_on_whole_heads_and_the_mlp_"
         "in_grains"),
    done("tensor_parallel.vocab_parallel_lm_head", "a Hugging Face causal LM's input embedding and LM head (tied "
         "or not) cut by vocabulary rows, its logits left cut and its loss the vocabulary-parallel cross-entropy: no "
         "rank holds the whole vocabulary's logits", AUTOTP_TESTS + "test_vocab_parallel_embedding_and_loss_train_"
         "as_the_unsplit_run_without_whole_logits"),
    done("tensor_parallel.vocab_parallel_ce_backend", "the vocabulary-parallel cross-entropy's kernel: torch's ops",
         AUTOTP_TESTS + "test_vocab_parallel_embedding_and_loss_train_as_the_unsplit_run_without_whole_logits",
         AUTOTP_UNIT + "test_bad_partition_config_values_are_refused_naming_the_key", traced=False,  # one value acts (torch); the schema and the refused value decide, nothing reads it later
         refused_values={"liger": "Liger's fused kernel is a Triton (GPU) kernel"}),
    done("tensor_parallel.tp.tp_group", "the tensor-parallel group the split communicates over (a process "
         "group object, in a dict config): it must hold this rank's tensor-parallel ranks of dsrun's layout (T "
         "consecutive ranks), else refused; beside tp.mpu, or unlike tp_model_init's group, refused (DeepSpeed's "
         "rules)",
         AUTOTP_TESTS + "test_a_given_tp_group_or_mpu_is_the_group_the_split_uses",
         AUTOTP_TESTS + "test_a_tp_group_other_than_the_topologys_is_refused",
         AUTOTP_UNIT + "test_given_groups_deepspeed_refuses_together_are_refused"),
    done("tensor_parallel.tp.mpu", "a model-parallel unit: its get_model_parallel_group() is the tensor-parallel "
         "group the split uses (as DeepSpeed's AutoTP reads an mpu), its get_data_parallel_group(), when it has one, "
         "must be the layout's data-parallel group; either refused when it is not",
         AUTOTP_TESTS + "test_a_given_tp_group_or_mpu_is_the_group_the_split_uses",
         AUTOTP_TESTS + "test_a_tp_group_other_than_the_topologys_is_refused",
         AUTOTP_UNIT + "test_given_groups_deepspeed_refuses_together_are_refused"),
    done("tensor_parallel.dtype", "the dtype the split model trains in, when given: it must be the one the precision "
         "section gives the model (fp16, bf16, else fp32; DeepSpeed's engine casts by that section) and "
         "tp_model_init's dtype; a conflict is refused (DeepSpeed refuses the tp_model_init one)",
         AUTOTP_UNIT + "test_tensor_parallel_dtype_must_be_the_dtype_the_run_trains_in",
         AUTOTP_TESTS + "test_zero_stages_0_and_2_bf16_and_tp_overlap_comm_split_the_same_way"),
    done("tensor_parallel.injection_policy_tuple", "DeepSpeed's injection policy tuple: the row-parallel (all-reduced) "
         "linears of every Transformer block, by their path in the block; the block's other linears column-parallel, "
         "the rest of the model whole; instead of the model's Hugging Face plan and the automatic reading (refused "
         "beside partition_config / preset_model, or naming no linear)",
         AUTOTP_UNIT + "test_the_injection_policy_tuple_splits_each_block_by_its_row_parallel_names",
         AUTOTP_TESTS + "test_injection_policy_tuple_names_the_row_parallel_linears_of_each_block"),
    done("tensor_parallel.keep_module_on_host", "true: the split's slices stay on the host where the model is, not "
         "copied (a cut along the first dimension is a view of the whole weight), until the engine moves the module "
         "or ZeRO copies it into its flat buffer; "
         "false: each slice is a copy of its own on the accelerator as it is cut (DeepSpeed's "
         "TensorParallel_Layer.move)",
         AUTOTP_UNIT + "test_keep_module_on_host_keeps_the_slices_as_views_of_the_host_weights",
         AUTOTP_TESTS + "test_zero_stages_0_and_2_bf16_and_tp_overlap_comm_split_the_same_way"),
    todo("tensor_parallel.kernel_inject", "inject inference kernels", Feature(
        "kernel injection in training", "DeepSpeed's training engine never reads it and the injected layer has no "
        "backward; inject for inference: init_inference(model, replace_with_kernel_inject=True), docs/inference.md")),
    # DeepCompile
    done("compile.deepcompile", "ZeRO-3 inside the compiled graph: DeepCompile's gather/release, reduce, prefetch "
         "and selective-gather passes (stages 1-2, and ZeRO-3 kept whole, use the torch compiler)",
         f"{DC}test_zero3_in_the_graph_trains_as_eager_zero3", f"{DC}test_deepcompile_falls_back_where_deepspeed_does",
         traced=False),  # read by engine.compile(), which a config without compile.enabled never calls
    done("compile.debug_log", "print each graph after DeepCompile's passes (rank 0)",
         f"{DC}test_the_passes_put_zero3_in_the_graph", traced=False),
    done("compile.passes", "DeepCompile's parallelization passes: [\"autotp\"] compiles an AutoTP-split model as one "
         "graph with its tensor-parallel collectives in the graph (compile.deepcompile and tensor_parallel.autotp_size "
         "> 1; otherwise the torch compiler); [\"autosp\"] compiles the model as one graph that splits the tagged "
         "inputs' sequence over sequence_parallel_size ranks with Ulysses all-to-alls around each SDPA (ZeRO stage "
         "0-1; otherwise the torch compiler)", TP_COMPILE + "test_the_autotp_pass_puts_the_collectives_in_the_graph",
         GRAPH_EDITS + "test_autosp_trains_with_the_losses_of_the_unsplit_model",
         traced=False,  # read by engine.compile()
         refused_values={"z1": "DeepSpeed reads it only to refuse it beside 'autotp'; dsrun's ZeRO passes follow "
                         "zero_optimization.stage with compile.deepcompile",
                         "z3": "DeepSpeed reads it only to refuse it beside 'autotp'; dsrun's ZeRO passes follow "
                         "zero_optimization.stage with compile.deepcompile"}),
    done("compile.offload_opt_states", "DeepCompile's optimizer-state offload (from step 1): Adam's moments and the "
         "fp32 masters the shards do not alias leave for host buffers at the forward's start and come back in the "
         "backward, keeping resident what the budget allows (refused beside offload_optimizer cpu/nvme)",
         f"{DC}test_zero3_in_the_graph_trains_as_eager_zero3", f"{DC}test_schedules_are_checked_against_the_contracts",
         traced=False),  # read by engine.compile()
    done("compile.offload_activation", "DeepCompile's activation offload: saved values to host buffers after their "
         "last forward use, back before their first backward reader; from step 5 what fits the budget stays",
         f"{DC}test_offload_activation_moves_saved_values_out_and_back", traced=False),
    done("compile.offload_activation_pin_memory", "page-locked host buffers of the activation offload (with an "
         "accelerator)", f"{DC}test_offload_activation_moves_saved_values_out_and_back", traced=False),
    done("compile.free_activation", "free each saved activation right after its last backward reader (eager and "
         "aot_eager backends; refused with inductor)",
         f"{DC}test_free_activation_releases_saved_values_after_their_last_backward_use", traced=False),
    done("compile.free_activation_threshold", "bytes from which compile.free_activation frees a value",
         f"{DC}test_free_activation_releases_saved_values_after_their_last_backward_use", traced=False),
    done("compile.offload_parameters", "DeepCompile's parameter offload: in each graph a ZeRO-3 shard (fp32: its "
         "sub-group's master, which the shards are views of) comes back from its host buffer just before its "
         "gather and goes there after the gathered value's last use; every shard back before the step and a "
         "checkpoint (refused beside offload_opt_states, offload_activation, or a schedule without the pass)",
         f"{DC}test_offload_parameters_moves_each_shard_out_after_its_last_use",
         f"{DC}test_zero3_in_the_graph_trains_as_eager_zero3", f"{DC}test_schedules_are_checked_against_the_contracts",
         traced=False),  # read by engine.compile()
    *[done(f"compile.sync_{point}_{op}", f"synchronize the accelerator {point} each {what} of DeepCompile's graph "
           "(DeepSpeed's debugging switch; on a CPU there is no queued device work: a count, the handle's stats.syncs)",
           f"{DC}test_the_passes_put_zero3_in_the_graph", f"{DC}test_zero3_in_the_graph_trains_as_eager_zero3",
           traced=False)  # read by engine.compile()
      for point in ("before", "after") for op, what in (("reduce", "gradient reduction"), ("allgather", "gather"))],
    done("compile.keep_int_input_tensors", "keep the values of a compiled graph's integer and bool inputs for a "
         "pass that runs the graph again (else tensors of ones of their layout)",
         f"{DC}test_prefetch_and_selective_gather_from_their_step", traced=False),
    done("compile.keep_all_input_tensors", "keep the values of all of a compiled graph's inputs for a pass that "
         "runs the graph again", f"{DC}test_the_passes_put_zero3_in_the_graph", traced=False),
    done("compile.double_buffer", "a launched reduce bucket's reduce-scatter runs on while the next bucket fills "
         "(two in flight at most); false: each gradient waits for the reduction in flight (one at most; the handle's "
         "stats.peak_reduces_in_flight; no effect with zero_optimization.overlap_comm false: nothing is in flight)",
         f"{DC}test_zero3_in_the_graph_trains_as_eager_zero3", traced=False),  # read by engine.compile()
    todo("compile.symmetric_memory", "all-gather through CUDA symmetric memory", Feature(
        "CUDA symmetric-memory all-gathers (torch.distributed._symmetric_memory: CUDA and NCCL only)",
        "leave compile.symmetric_memory false"), applies=lambda cfg: cfg.compile.enabled or cfg.compile.deepcompile),
    done("compile.autoep_non_moe", "engine.compile() compiles the modules around the AutoEP layers and keeps the "
         "AutoEP layers eager (refused with DeepCompile, AutoTP folding, sequence or pipeline parallelism, ZeRO-3, "
         "offload)", "tests/unit/moe/test_autoep.py::test_autoep_non_moe_compiles_the_blocks_and_keeps_the_moe_layers"
         "_eager", traced=False),  # read by engine.compile()
]
