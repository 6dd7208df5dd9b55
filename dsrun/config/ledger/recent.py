"""Ledger entries for the keys DeepSpeed added between 0.14 and 0.19 (dsrun/config/recent.py and the new
fields of the older sections). ``torch_autocast`` and ``checkpoint.writer.decoupled`` act; the rest are refused when
a config enables them.
"""
from __future__ import annotations

from .entry import Entry, Feature, done, todo

AUTOCAST = "tests/unit/runtime/test_torch_autocast.py::"
ENGINE = Feature("", "leave the key at its default")
ZENFLOW = Feature("ZenFlow (stall-free offloaded optimizer)", "remove zero_optimization.zenflow")
WRITER = Feature("DeepSpeed's fast checkpoint writers (O_DIRECT, double buffering, split writes): dsrun writes "
                 "with torch.save", "remove the key (checkpoint.writer.decoupled acts)")
AUTOTP = Feature("AutoTP tensor-parallel training", "remove the tensor_parallel section")
DEEPCOMPILE = Feature("DeepCompile (compiler passes for ZeRO)", "leave the compile key at its default")
SUPER = Feature("SuperOffload (CPU Adam on reserved cores, superchips)", "leave super_offload false")
LEAF = Feature("ZeRO-3 leaf modules from the config", "leave zero_optimization.leaf_module empty")
DTYPES = Feature("separate parameter and buffer dtypes", "use bf16/fp16 sections for the model dtype")


def _stage3(cfg) -> bool:
    return cfg.zero_optimization.stage == 3


def _muon_on_nvme(cfg) -> bool:
    return (cfg.optimizer is not None and (cfg.optimizer.type or "").lower() == "muon" and _stage3(cfg)
            and cfg.zero_optimization.offload_optimizer_device == "nvme")


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
    todo("log_level", "DeepSpeed's logger level", ENGINE),
    todo("managed_gradient_accumulation", "false: the user's loop accumulates and reduces gradients", ENGINE),
    todo("disable_python_gc", "turn Python's cyclic GC off, collecting at safe step boundaries", ENGINE),
    todo("expert_parallel", "AutoEP: expert parallelism for Hugging Face MoE models",
         Feature("AutoEP", "remove expert_parallel; use dsrun.moe.layer.MoE")),
    todo("datastates_ckpt", "DataStates asynchronous checkpointing", Feature("DataStates-LLM checkpointing",
         "remove datastates_ckpt"), active=lambda cfg: cfg.datastates_ckpt not in (None, False)),
    done("bf16.check_grad_overflow", "at ZeRO stages 1-2 (where DeepSpeed 0.19 checks): skip a bf16 step whose "
         "gradients hold inf/nan", "tests/unit/runtime/test_config_effects.py::test_key_changes_behaviour[{key}]"),
    *_section("data_types", DTYPES, {"param_dtype": "dtype of the model's parameters",
                                     "buffer_dtype": "dtype of the model's buffers",
                                     "keep_in_fp32_modules": "modules whose buffers stay fp32"}),
    todo("aio.use_gds", "NVIDIA GPUDirect Storage for NVMe I/O", Feature("GPUDirect Storage (CUDA)",
                                                                        "leave use_gds false")),
    todo("hybrid_engine.enable_cuda_graph", "CUDA graphs in the hybrid engine's generation",
         Feature("the hybrid train/generate engine (DeepSpeed-Chat)", "disable hybrid_engine")),
    todo("checkpoint.checkpoint_serialization", "false: torch.save without the zipfile format", ENGINE),
    # decoupled acts (dsrun/checkpoint/decoupled.py); the fast writers' own keys wait for those writers
    done("checkpoint.writer.decoupled", "save in the background: training waits only for a host-memory snapshot; "
         "the checkpoint is published once every rank's files are durable",
         "tests/integration/test_decoupled_checkpoint.py::test_a_decoupled_save_resumes_bit_exactly_while_training_"
         "goes_on"),
    *_section("checkpoint.writer", WRITER, {
        "type": "writer: MOCK, PYTHON or FAST", "io_buffer_size": "bytes of the writer's I/O buffer",
        "io_buffer_double": "double-buffered writes", "show_statistics": "print write statistics",
        "data_parallel": "which data-parallel ranks write", "io_multiplier": "I/O buffer multiplier"}),
    # ZeRO
    todo("zero_optimization.compute_grad_norm", "false: skip the global gradient norm (stages 1-2)", ENGINE),
    todo("zero_optimization.stage3_allgather_sequential", "gather parameters one at a time", ENGINE,
         applies=_stage3),
    todo("zero_optimization.parameter_alignment", "align partition boundaries of each parameter", ENGINE),
    todo("zero_optimization.enable_sanity_checks", "extra ZeRO consistency checks", ENGINE),
    # DeepSpeed reads it only for Muon at stage 3 with NVMe optimizer offload, which dsrun refuses (Muon's matrices
    # must be in memory at the step); everywhere else dsrun keeps the momentum in memory, as the key asks
    todo("zero_optimization.save_muon_momentum_buffer_in_memory", "keep Muon's momentum in memory instead of "
         "swapping it to NVMe with the other optimizer states (ZeRO-3)",
         Feature("Muon with NVMe optimizer offload", "offload the optimizer to cpu"), applies=_muon_on_nvme),
    *_section("zero_optimization.leaf_module", LEAF, {"classes": "leaf module classes",
                                                      "names": "leaf module names",
                                                      "name_suffixes": "leaf module name suffixes"},
              applies=_stage3),
    todo("zero_optimization.offload_optimizer.super_offload", "SuperOffload's CPU optimizer", SUPER),
    todo("zero_optimization.offload_optimizer.cpuadam_cores_perc", "fraction of cores for SuperOffload's CPU "
         "Adam", SUPER, applies=lambda cfg: cfg.zero_optimization.offload_optimizer.super_offload),
    *_section("zero_optimization.zenflow", ZENFLOW, {
        "topk_ratio": "share of gradients updated on the accelerator", "select_strategy": "how to pick them",
        "select_interval": "steps between selections", "update_interval": "steps between CPU updates",
        "overlap_step": "overlap the CPU step", "offload": "offload the optimizer",
        "auto_ratio": "the auto update interval's threshold", "full_warm_up_rounds": "full updates first",
        "pt_reserved_cores_perc": "cores kept for PyTorch", "steps_per_epoch": "steps in an epoch"}),
    # AutoTP training
    *_section("tensor_parallel", AUTOTP, {
        "dtype": "dtype of the sharded model", "autotp_size": "tensor-parallel degree",
        "tp_overlap_comm": "overlap TP communication", "vocab_parallel_lm_head": "shard the LM head",
        "vocab_parallel_ce_backend": "vocab-parallel cross-entropy backend", "tp.tp_size": "TP degree",
        "tp.tp_grain_size": "shard granularity", "tp.mpu": "model-parallel unit", "tp.tp_group": "TP group",
        "injection_policy_tuple": "layer injection policy", "partition_config": "partitioning rules",
        "preset_model": "a preset model's rules", "keep_module_on_host": "keep shards on the host",
        "kernel_inject": "inject inference kernels"}),
    # DeepCompile
    *_section("compile", DEEPCOMPILE, {
        "deepcompile": "DeepCompile's ZeRO passes", "autoep_non_moe": "AutoEP on non-MoE layers",
        "free_activation": "free activations early", "free_activation_threshold": "bytes above which to free",
        "offload_activation": "offload activations", "offload_activation_pin_memory": "pin offloaded "
        "activations", "offload_opt_states": "offload optimizer states", "double_buffer": "double-buffer "
        "prefetches", "symmetric_memory": "symmetric-memory all-gathers", "debug_log": "DeepCompile debug log",
        "offload_parameters": "offload parameters", "sync_before_reduce": "synchronize before reductions",
        "sync_after_reduce": "synchronize after reductions", "sync_before_allgather": "synchronize before "
        "all-gathers", "sync_after_allgather": "synchronize after all-gathers", "keep_int_input_tensors":
        "keep integer inputs", "keep_all_input_tensors": "keep all inputs", "passes": "DeepCompile passes"},
        applies=lambda cfg: cfg.compile.enabled or cfg.compile.deepcompile),
]
