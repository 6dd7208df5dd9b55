"""Cross-field rules: what one section allows depends on another (config-keys.md §3 and §5).

Errors are :class:`~dsrun.utils.errors.Problem`; advice about keys that have no effect in the chosen
setting (DeepSpeed ignores them silently) is returned as note strings and logged, not raised.
"""
from __future__ import annotations

import re
from typing import Any

from dsrun.utils.errors import Problem, show

from .compression import check_compression, check_quantization_modes
from .data_efficiency import check_data_efficiency
from .misc import SPARSE_MODE_KEYS
from .model import DSConfig
from .optim import (
    CPU_OPTIMIZER_TYPES,
    DYNAMIC_LOSS_SCALE_OPTIMIZERS,
    MUON_OPTIMIZER_NAMES,
    NATIVE_OPTIMIZERS,
    ONE_BIT_OPTIMIZERS,
    ZERO_TESTED_OPTIMIZERS,
    check_optimizer,
    check_scheduler,
    offload_optimizer_problem,
)

_COMET_KEY = re.compile(r"^[A-Za-z0-9]{32,50}$")


def _given(raw: dict[str, Any], *keys: str) -> bool:
    node: Any = raw
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def check_precision(cfg: DSConfig, p: str) -> list[Problem]:
    problems: list[Problem] = []
    if cfg.fp16.enabled and cfg.bf16.enabled:
        problems.append(Problem(f"{p}bf16.enabled", "fp16 and bf16 cannot both be enabled", "choose one precision"))
    if cfg.amp.enabled and (cfg.fp16.enabled or cfg.bf16.enabled):
        other = "fp16" if cfg.fp16.enabled else "bf16"
        problems.append(Problem(f"{p}amp.enabled", f"amp cannot be combined with {other}",
                                f"disable {other} or amp"))
    if cfg.amp.enabled and cfg.zero_optimization.stage > 0:
        problems.append(Problem(f"{p}amp.enabled",
                                f"amp is not compatible with ZeRO (zero_optimization.stage is "
                                f"{cfg.zero_optimization.stage})", "use fp16 or bf16 with ZeRO instead of amp"))
    if cfg.amp.enabled and cfg.data_types.grad_accum_dtype not in (None, "fp32"):
        problems.append(Problem(f"{p}data_types.grad_accum_dtype",
                                f"got {cfg.data_types.grad_accum_dtype!r}; with amp the gradients accumulate "
                                "in the model dtype, fp32"))
    problems += _bf16_master_state_problems(cfg, p)
    problems += _grad_accum_problems(cfg, p)
    # DeepSpeed's engine asserts that data_types.param_dtype names the dtype fp16/bf16 give the model
    param_dtype, model_dtype = cfg.data_types.param_dtype, {"fp16": "fp16", "bf16": "bf16"}.get(cfg.precision, "fp32")
    if param_dtype is not None and param_dtype != model_dtype:
        problems.append(Problem(f"{p}data_types.param_dtype", f"got {param_dtype!r}, but the enabled precision gives "
                                f"the model {model_dtype} parameters (DeepSpeed refuses the conflict too)",
                                "set the matching fp16/bf16 enabled flag, or remove data_types.param_dtype"))
    problems += _fp16_master_problems(cfg, p)
    if cfg.torch_autocast.enabled and cfg.data_types.keep_in_fp32_modules not in ("auto", []):
        problems.append(keep_fp32_autocast_problem(p))
    return problems


def keep_fp32_autocast_problem(p: str) -> Problem:
    """``data_types.keep_in_fp32_modules`` keeping tensors beside ``torch_autocast``, which would run the kept modules'
    forward in its 16-bit dtype (and reduce its safe modules' gradients in it): the config check refuses a listed
    module, the engine's cast what "auto" keeps."""
    return Problem(f"{p}data_types.keep_in_fp32_modules", "keeps modules fp32, but torch_autocast.enabled runs their "
                   "forward in the autocast dtype too (and reduces its safe modules' gradients in it)",
                   "turn torch_autocast off (bf16 or fp16 alone keeps the listed modules fp32), or set "
                   "data_types.keep_in_fp32_modules to []")


def _fp16_master_problems(cfg: DSConfig, p: str) -> list[Problem]:
    """``fp16.fp16_master_weights_and_grads`` (read only with fp16 enabled) where DeepSpeed runs it: ZeRO stage 1-3
    with the optimizer offloaded and stepped by its CPU Adam (``_configure_master_weights``' assertions); dsrun
    keeps the fp16 masters in host memory (not in NVMe swap files), all of them (offload ratio 1), without ZenFlow."""
    z = cfg.zero_optimization
    if not (cfg.fp16.enabled and cfg.fp16.fp16_master_weights_and_grads):
        return []
    path, stage, device = f"{p}fp16.fp16_master_weights_and_grads", z.stage, z.offload_optimizer.device
    if stage == 0:
        return [Problem(path, "fp16 master weights and gradients need ZeRO stage 1, 2 or 3 (as in DeepSpeed), "
                        "stage is 0", "set zero_optimization.stage to 1, 2 or 3, or remove the key")]
    if device == "none":
        return [Problem(path, f"needs the optimizer offloaded to the CPU and stepped by DeepSpeedCPUAdam (DeepSpeed "
                        f"asserts it); stage {stage}, offload_optimizer.device is none",
                        "set zero_optimization.offload_optimizer.device to cpu, or remove the key")]
    name = (cfg.optimizer.type or "").lower() if cfg.optimizer is not None else ""
    torch_adam = bool((cfg.optimizer.params or {}).get("torch_adam")) if cfg.optimizer is not None else False
    if cfg.optimizer is not None and (name not in ("adam", "adamw") or torch_adam):
        return [Problem(path, f"fp16 masters are stepped by ZeRO-Offload's DeepSpeedCPUAdam (as DeepSpeed requires); "
                        f"optimizer.type is {cfg.optimizer.type}" + (" with torch_adam" if torch_adam else ""),
                        "use optimizer type Adam or AdamW, or remove the key")]
    unsupported = ("offload_optimizer.device 'nvme' (fp16 masters in swap files)" if device == "nvme" else
                   f"offload_optimizer.ratio {z.offload_optimizer.ratio} (fp16 masters on the device)"
                   if z.offload_optimizer.ratio < 1.0 else "zero_optimization.zenflow" if z.zenflow is not None
                   else None)
    if unsupported:
        return [Problem(path, f"fp16 master state with {unsupported} is not implemented in this version of dsrun; "
                        f"stage {stage}", "offload the whole optimizer to cpu, or remove the key")]
    return []


def _bf16_master_state_problems(cfg: DSConfig, p: str) -> list[Problem]:
    """``bf16.bf16_master_weights_and_grads`` / ``bf16_optimizer_states`` where dsrun keeps them (docs/precision.md):
    bf16 enabled, ZeRO stage 1-3 (DeepSpeed's only stages for them), both keys together (DeepSpeed's other
    supported mix, bf16 masters with fp32 states, needs ZeRO-Offload's CPU Adam), master state on the device."""
    bf, stage = cfg.bf16, cfg.zero_optimization.stage
    if not (bf.bf16_master_weights_and_grads or bf.bf16_optimizer_states):
        return []
    key = "bf16_master_weights_and_grads" if bf.bf16_master_weights_and_grads else "bf16_optimizer_states"
    path = f"{p}bf16.{key}"
    if not bf.enabled:
        return [Problem(path, "acts only on a bf16 model's master state, and bf16.enabled is false",
                        "set bf16.enabled to true, or remove the key")]
    if stage == 0:
        return [Problem(path, "bf16 master state needs ZeRO stage 1, 2 or 3 (as in DeepSpeed), stage is 0",
                        "set zero_optimization.stage to 1, 2 or 3, or remove the key (stage 0 keeps fp32 masters)")]
    if not bf.bf16_master_weights_and_grads:
        return [Problem(path, f"needs bf16.bf16_master_weights_and_grads (as in DeepSpeed); stage {stage}",
                        "set bf16.bf16_master_weights_and_grads to true as well")]
    if not bf.bf16_optimizer_states:
        return [Problem(path, f"bf16 masters beside fp32 optimizer states (DeepSpeed: ZeRO-Offload with its CPU "
                        f"Adam) are not implemented in this version of dsrun; stage {stage}",
                        "set bf16.bf16_optimizer_states to true as well, or remove the key")]
    opt_type = (cfg.optimizer.type or "").lower() if cfg.optimizer is not None else ""
    if opt_type in ONE_BIT_OPTIMIZERS:
        return [Problem(path, f"bf16 master state with {cfg.optimizer.type} (its compressed exchange keeps fp32 "
                        f"moments and error buffers) is not implemented in this version of dsrun; stage {stage}",
                        "use Adam/AdamW, Lamb, Lion or Muon, or remove the bf16 master keys")]
    device = cfg.zero_optimization.offload_optimizer.device
    if device != "none":
        return [Problem(path, f"bf16 master state with offload_optimizer.device {device!r} is not implemented in "
                        f"this version of dsrun (dsrun keeps it on the device); stage {stage}",
                        "set zero_optimization.offload_optimizer.device to none, or remove the bf16 master keys")]
    return []


def separate_bf16_fp32_accumulation(cfg: DSConfig) -> bool:
    """ZeRO stage 1 accumulating a bf16 model's gradients in fp32: DeepSpeed's ``BF16_Optimizer``, the one place
    ``bf16.immediate_grad_update`` chooses when each gradient joins the fp32 accumulator."""
    return (cfg.bf16.enabled and cfg.zero_optimization.stage == 1 and cfg.data_types.grad_accum_dtype == "fp32"
            and cfg.native_grad_accum_dtype != "fp32")


def _grad_accum_problems(cfg: DSConfig, p: str) -> list[Problem]:
    """``data_types.grad_accum_dtype`` naming another dtype than the one dsrun accumulates in anyway
    (``DSConfig.native_grad_accum_dtype``): DeepSpeed 0.19 accepts any dtype at ZeRO 1-3 and, without ZeRO, only
    the model's (its engine raises NotImplementedError for another); dsrun keeps the separate accumulator on the
    device, beside optimizers that read the strategy's gradients through its ordinary buffers."""
    asked, stage = cfg.data_types.grad_accum_dtype, cfg.zero_optimization.stage
    if asked is None or asked == cfg.native_grad_accum_dtype or cfg.amp.enabled:  # amp: check_precision's rule
        return []
    path, model = f"{p}data_types.grad_accum_dtype", {"fp16": "fp16", "bf16": "bf16"}.get(cfg.precision, "fp32")
    if stage == 0:
        return [Problem(path, f"got {asked!r}; without ZeRO gradients accumulate in the model's dtype ({model}), "
                        "and DeepSpeed refuses another (NotImplementedError: unsupported mix); stage is 0",
                        "set zero_optimization.stage to 1, 2 or 3, or remove data_types.grad_accum_dtype")]
    device = cfg.zero_optimization.offload_optimizer.device
    if device != "none":
        return [Problem(path, f"got {asked!r} with offload_optimizer.device {device!r}: a gradient accumulation "
                        f"dtype other than {cfg.native_grad_accum_dtype} beside an offloaded optimizer is not "
                        f"implemented in this version of dsrun (its host stores accumulate in fp32); stage {stage}",
                        "set zero_optimization.offload_optimizer.device to none, or remove "
                        "data_types.grad_accum_dtype")]
    opt_type = (cfg.optimizer.type or "").lower() if cfg.optimizer is not None else ""
    if opt_type in ONE_BIT_OPTIMIZERS:
        return [Problem(path, f"got {asked!r} with {cfg.optimizer.type} (its compressed exchange reads each rank's "
                        "model-dtype gradients) is not implemented in this version of dsrun; stage "
                        f"{stage}", "remove data_types.grad_accum_dtype")]
    return []


def _super_offload_problems(cfg: DSConfig, zp: str) -> list[Problem]:
    """``offload_optimizer.super_offload`` steps each NVMe sub-group during backward (dsrun/offload/backward_step.py):
    only where that update equals the step's, with no global norm or loss scale to wait for."""
    z, key = cfg.zero_optimization, f"{zp}.offload_optimizer.super_offload"
    if not z.offload_optimizer.super_offload:
        return []
    if z.stage != 3 or z.offload_optimizer.device != "nvme":
        return [Problem(key, f"is implemented for ZeRO stage 3 with offload_optimizer.device 'nvme' (got stage "
                        f"{z.stage}, device {z.offload_optimizer.device!r}); on the CPU the overlapped step is ZenFlow",
                        "leave super_offload false, or use zero_optimization.zenflow")]
    if cfg.gradient_clipping:
        return [Problem(key, f"steps sub-groups before the global gradient norm exists; gradient_clipping is "
                        f"{cfg.gradient_clipping}", "set gradient_clipping to 0, or leave super_offload false")]
    if cfg.fp16.enabled:
        return [Problem(key, "steps sub-groups before the overflow check and the loss scale are known; fp16 is on",
                        "use bf16, or leave super_offload false")]
    if cfg.optimizer is not None and (cfg.optimizer.type or "").lower() in MUON_OPTIMIZER_NAMES:
        return [Problem(key, "steps sub-groups during backward, before Muon's whole-matrix updates exist (they need "
                        "every rank's gradient of each matrix); the optimizer is Muon", "leave super_offload false")]
    return []


def check_zero(cfg: DSConfig, raw: dict[str, Any], p: str) -> tuple[list[Problem], list[str]]:
    z = cfg.zero_optimization
    zp = f"{p}zero_optimization"
    problems: list[Problem] = []
    notes: list[str] = []
    if z.offload_param.device != "none" and z.stage != 3:
        problems.append(Problem(f"{zp}.offload_param.device",
                                f"parameter offload ({z.offload_param.device!r}) needs ZeRO stage 3, stage is {z.stage}",
                                "set zero_optimization.stage to 3 or remove offload_param"))
    opt = z.offload_optimizer
    if opt.device != "none":
        if z.stage == 0:
            problems.append(Problem(f"{zp}.offload_optimizer.device",
                                    f"optimizer offload ({opt.device!r}) needs ZeRO stage 1, 2 or 3, stage is 0",
                                    "set zero_optimization.stage"))
        elif opt.device == "nvme" and z.stage != 3:
            problems.append(Problem(f"{zp}.offload_optimizer.device",
                                    f"NVMe optimizer offload needs ZeRO stage 3, stage is {z.stage}",
                                    "use device 'cpu' or stage 3"))
        problems += _super_offload_problems(cfg, zp)
        if opt.ratio < 1.0 and z.stage != 3:
            problems.append(Problem(f"{zp}.offload_optimizer.ratio",
                                    f"got {opt.ratio}; partial offload (ratio < 1) needs ZeRO stage 3, stage is {z.stage}"))
    for name, section in (("offload_param", z.offload_param), ("offload_optimizer", z.offload_optimizer)):
        if section.device == "nvme" and not section.nvme_path:
            problems.append(Problem(f"{zp}.{name}.nvme_path", "required when device is 'nvme'",
                                    "a directory on a fast local NVMe drive, e.g. /local_nvme"))

    zraw = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    stage3_keys = [k for k in zraw if k.startswith("stage3_")]
    if z.stage != 3 and stage3_keys:
        notes.append(f"{zp}: {', '.join(stage3_keys)} only matter at stage 3 (stage is {z.stage})")
    if "grad_hooks" in zraw and z.stage != 1:
        notes.append(f"{zp}.grad_hooks only matters at stage 1")
    for key in ("round_robin_gradients", "parameter_alignment"):  # DeepSpeed's stage_1_and_2.py reads them
        if getattr(z, key) and z.stage not in (1, 2):
            notes.append(f"{zp}.{key} only matters at stages 1-2")
    if z.zero_hpz_partition_size > 1 and z.stage != 3:
        notes.append(f"{zp}.zero_hpz_partition_size (hpZ) only matters at stage 3")
    if z.zenflow is not None:
        problems += z.zenflow.problems(f"{zp}.zenflow", z.stage, z.offload_optimizer.device)
    elif z.offload_optimizer.cpuadam_cores_perc != 0.8 and not z.offload_optimizer.super_offload:
        notes.append(f"{zp}.offload_optimizer.cpuadam_cores_perc only matters for the overlapped CPU step of "
                     "zero_optimization.zenflow (and super_offload)")
    if cfg.gradient_allreduce_op == "sum":  # DeepSpeed's own limits of the summed reduction
        where = ("ZeRO stage 3" if z.stage == 3 else "ZenFlow" if z.zenflow is not None
                 else "DeepCompile" if cfg.compile.deepcompile else "")
        if where:
            problems.append(Problem(f"{p}gradient_allreduce_op", f"'sum' is not supported with {where}",
                                    "use \"mean\" (the default)"))
    if (z.mics_shard_size > 0 or z.mics_hierarchical_params_gather) and z.stage != 3:
        notes.append(f"{zp}.mics_shard_size / mics_hierarchical_params_gather (MiCS) only matter at stage 3")
    elif z.mics_hierarchical_params_gather and z.mics_shard_size < 1:
        notes.append(f"{zp}.mics_hierarchical_params_gather only matters with mics_shard_size set (MiCS)")
    zeropp_keys = [k for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                               "zero_quantized_gradients", "zeropp_loco_param") if getattr(z, k)]
    if zeropp_keys and z.stage != 3:
        notes.append(f"{zp}: {', '.join(zeropp_keys)} (ZeRO++) only matter at stage 3 (stage is {z.stage})")
    if z.zeropp_loco_param is not None:
        problems += _loco_problems(z.zeropp_loco_param, f"{zp}.zeropp_loco_param", z.stage, z.zero_quantized_gradients)
    if cfg.bf16.enabled and cfg.bf16.immediate_grad_update and not separate_bf16_fp32_accumulation(cfg):
        notes.append(f"{p}bf16.immediate_grad_update only chooses something at ZeRO stage 1 with "
                     "data_types.grad_accum_dtype fp32 (DeepSpeed's BF16_Optimizer); the other stages add each "
                     "gradient where it accumulates as its hook fires already")
    uses_nvme = "nvme" in (z.offload_param_device, z.offload_optimizer_device)
    if _given(raw, "aio") and not uses_nvme:
        notes.append(f"{p}aio only matters with NVMe offload")
    return problems, notes


def _loco_problems(loco: dict, key: str, stage: int, qgz: bool) -> list[Problem]:
    """LoCo (``zeropp_loco_param``: ``{"err_beta": 0 <= b < 1, "reset_T": steps > 0}``) is error feedback for
    qgZ's quantized reduce-scatter: nothing to act on without it (DeepSpeed ignores it there)."""
    if not isinstance(loco, dict):
        return [Problem(key, f"must be a mapping, got {loco!r}", 'use {"err_beta": 0.8, "reset_T": 1024}')]
    unknown = sorted(set(loco) - {"err_beta", "reset_T"})
    if unknown:
        return [Problem(f"{key}.{unknown[0]}", "is not a LoCo setting", "use err_beta and reset_T")]
    problems = []
    beta, reset = loco.get("err_beta", 0.8), loco.get("reset_T", 1024)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
        problems.append(Problem(f"{key}.err_beta", f"must be a number in [0, 1), got {beta!r}", "DeepSpeed uses 0.8"))
    if isinstance(reset, bool) or not isinstance(reset, int) or reset < 1:
        problems.append(Problem(f"{key}.reset_T", f"must be a positive number of steps, got {reset!r}",
                                "DeepSpeed uses 1024"))
    if stage == 3 and not qgz:
        problems.append(Problem(key, "LoCo is error feedback for qgZ's quantized gradients, which are off",
                                "set zero_optimization.zero_quantized_gradients: true, or remove zeropp_loco_param"))
    return problems


def check_optimizer_rules(cfg: DSConfig, p: str) -> list[Problem]:
    problems: list[Problem] = []
    problems += check_optimizer(cfg.optimizer, p)
    problems += check_scheduler(cfg.scheduler, p)
    if cfg.optimizer.type is None:
        return problems
    name = cfg.optimizer.type.lower()
    stage = cfg.zero_optimization.stage
    if name in ONE_BIT_OPTIMIZERS:
        # dsrun runs them at stage 0 and (1-bit Adam and LAMB) stage 1; DeepSpeed refuses every stage > 0
        stages = (0,) if name == "zerooneadam" else (0, 1)
        offloaded = cfg.zero_optimization.offload_optimizer_device not in (None, "none")
        if stage not in stages or (stage > 0 and offloaded):
            allowed = " or ".join(str(s) for s in stages)
            problems.append(Problem(f"{p}optimizer.type",
                                    f"{NATIVE_OPTIMIZERS[name]} runs at ZeRO stage {allowed} without optimizer "
                                    f"offload (got stage {stage}{', offloaded' if stage in stages else ''})",
                                    f"set zero_optimization.stage to {allowed}; docs/onebit.md says why"))
    elif stage > 0 and name not in ZERO_TESTED_OPTIMIZERS and not cfg.zero_allow_untested_optimizer \
            and not any(pr.path == f"{p}optimizer.type" for pr in problems):
        problems.append(Problem(f"{p}optimizer.type",
                                f"{cfg.optimizer.type!r} is not an optimizer ZeRO is tested with "
                                "(Adam, AdamW, Lamb, Adagrad, Lion, Muon)",
                                "set \"zero_allow_untested_optimizer\": true to use it anyway"))
    device = cfg.zero_optimization.offload_optimizer_device
    torch_adam = name in ("adam", "adamw") and bool((cfg.optimizer.params or {}).get("torch_adam"))
    if stage > 0 and device in ("cpu", "nvme") and name not in ONE_BIT_OPTIMIZERS and \
            (name not in CPU_OPTIMIZER_TYPES or torch_adam):
        problem = offload_optimizer_problem(cfg.optimizer.type + (" (torch_adam)" if torch_adam else ""), device,
                                            cfg.zero_force_ds_cpu_optimizer, p)
        problems += [problem] if problem is not None else []
    if name in DYNAMIC_LOSS_SCALE_OPTIMIZERS and cfg.fp16.enabled and not cfg.fp16.dynamic_loss_scale:
        problems.append(Problem(f"{p}fp16.loss_scale",
                                f"got {cfg.fp16.loss_scale}; {NATIVE_OPTIMIZERS[name]} needs dynamic loss scaling",
                                "set fp16.loss_scale to 0"))
    return problems


def check_monitors(cfg: DSConfig, p: str) -> tuple[list[Problem], list[str]]:
    problems: list[Problem] = []
    notes: list[str] = []
    comet = cfg.comet
    if comet.enabled and comet.experiment_key is not None and not _COMET_KEY.match(comet.experiment_key):
        problems.append(Problem(f"{p}comet.experiment_key",
                                f"got {show(comet.experiment_key)}; allowed: 32 to 50 letters and digits"))
    if comet.enabled and comet.mode == "get" and comet.experiment_key is None:
        problems.append(Problem(f"{p}comet.experiment_key", "required when comet.mode is 'get'",
                                "the key of the experiment to continue"))
    if not cfg.comms_logger.prof_all and cfg.comms_logger.enabled and not cfg.comms_logger.prof_ops:
        notes.append(f"{p}comms_logger: prof_all is false and prof_ops is empty, so no collective is profiled")
    return problems, notes


def check_tooling(cfg: DSConfig, raw: dict[str, Any], p: str) -> tuple[list[Problem], list[str]]:
    problems: list[Problem] = []
    notes: list[str] = []
    at = cfg.autotuning
    if at.enabled and at.end_profile_step < at.start_profile_step:
        problems.append(Problem(f"{p}autotuning.end_profile_step",
                                f"got {at.end_profile_step}; must be >= start_profile_step ({at.start_profile_step})"))
    if at.enabled and at.min_train_micro_batch_size_per_gpu > at.max_train_micro_batch_size_per_gpu:
        problems.append(Problem(f"{p}autotuning.min_train_micro_batch_size_per_gpu",
                                f"got {at.min_train_micro_batch_size_per_gpu}; must be <= "
                                f"max_train_micro_batch_size_per_gpu ({at.max_train_micro_batch_size_per_gpu})"))
    if at.enabled and at.max_train_batch_size is not None and at.max_train_batch_size < at.min_train_batch_size:
        problems.append(Problem(f"{p}autotuning.max_train_batch_size",
                                f"got {at.max_train_batch_size}; must be >= min_train_batch_size ({at.min_train_batch_size})"))

    el = cfg.elasticity
    ep = f"{p}elasticity"
    if el.enabled:  # DeepSpeed reads the section only when it is enabled
        if el.version not in (0.1, 0.2):
            problems.append(Problem(f"{ep}.version", f"got {el.version}; allowed: 0.1 or 0.2"))
        if el.max_gpus < el.min_gpus:
            problems.append(Problem(f"{ep}.max_gpus", f"got {el.max_gpus}; must be >= min_gpus ({el.min_gpus})"))
        for key in ("max_train_batch_size", "micro_batch_sizes"):
            if getattr(el, key) is None:
                problems.append(Problem(f"{ep}.{key}", "required when elasticity is enabled"))
        if el.micro_batch_sizes is not None and not el.micro_batch_sizes:
            problems.append(Problem(f"{ep}.micro_batch_sizes", "must list at least one micro batch size"))
        if el.micro_batch_sizes and el.max_train_batch_size is not None \
                and max(el.micro_batch_sizes) > el.max_train_batch_size:
            problems.append(Problem(f"{ep}.micro_batch_sizes",
                                    f"got {el.micro_batch_sizes}; every size must be <= max_train_batch_size "
                                    f"({el.max_train_batch_size})"))
        if el.model_parallel_size > 1 and el.version != 0.2:
            problems.append(Problem(f"{ep}.model_parallel_size",
                                    f"got {el.model_parallel_size}; model parallelism needs elasticity version 0.2"))
        if not el.ignore_non_elastic_batch_info:
            for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
                if key in raw:
                    problems.append(Problem(f"{p}{key}", "must not be given when elasticity is enabled: "
                                            "elasticity computes the batch sizes",
                                            "remove it, or set elasticity.ignore_non_elastic_batch_info"))
        if el.version == 0.2 and el.num_gpus_per_node % el.model_parallel_size:
            problems.append(Problem(f"{ep}.model_parallel_size",
                                    f"got {el.model_parallel_size}; must divide num_gpus_per_node ({el.num_gpus_per_node})"))
        el_raw = raw.get("elasticity", {})
        if el.version == 0.1 and "num_gpus_per_node" in el_raw:
            notes.append(f"{ep}.num_gpus_per_node only matters in version 0.2")
        if el.version == 0.2 and "min_time" in el_raw:
            notes.append(f"{ep}.min_time only matters in version 0.1")

    pipe = cfg.pipeline
    if pipe.schedule == "interleaved" and pipe.virtual_stages < 2:
        problems.append(Problem(f"{p}pipeline.virtual_stages", f"got {pipe.virtual_stages}; the interleaved "
                                "schedule needs at least 2 virtual stages per rank", "set pipeline.virtual_stages=2"))
    if pipe.schedule != "interleaved" and pipe.virtual_stages > 1:
        problems.append(Problem(f"{p}pipeline.virtual_stages", f"got {pipe.virtual_stages}; virtual stages "
                                f"belong to the interleaved schedule (schedule is {pipe.schedule!r})",
                                "set pipeline.schedule=interleaved or virtual_stages=1"))

    problems += cfg.activation_checkpointing.problems(f"{p}activation_checkpointing")
    if cfg.checkpoint.writer is not None:
        problems += cfg.checkpoint.writer.problems(f"{p}checkpoint.writer", cfg.aio.thread_count)

    sa = cfg.sparse_attention
    if sa is not None:
        sp = f"{p}sparse_attention"
        used = SPARSE_MODE_KEYS[sa.mode]
        if sa.horizontal_global_attention and sa.attention != "bidirectional" and "attention" in used:
            problems.append(Problem(f"{sp}.horizontal_global_attention",
                                    "only valid with attention 'bidirectional'", f"attention is {sa.attention!r}"))
        if sa.global_block_end_indices is not None and "global_block_indices" in used:
            if len(sa.global_block_end_indices) != len(sa.global_block_indices):
                problems.append(Problem(f"{sp}.global_block_end_indices",
                                        f"has {len(sa.global_block_end_indices)} entries, global_block_indices has "
                                        f"{len(sa.global_block_indices)}; they must match"))
            else:
                for i, (start, end) in enumerate(zip(sa.global_block_indices, sa.global_block_end_indices)):
                    if end <= start:
                        problems.append(Problem(f"{sp}.global_block_end_indices[{i}]",
                                                f"got {end}; must be > global_block_indices[{i}] ({start})"))
        if sa.mode == "fixed" and sa.num_different_global_patterns > 1 and not sa.different_layout_per_head:
            problems.append(Problem(f"{sp}.num_different_global_patterns",
                                    f"got {sa.num_different_global_patterns}; more than one pattern needs "
                                    "different_layout_per_head true"))
        sa_raw = raw.get("sparse_attention", {})
        unused = sorted(k for k in sa_raw if k not in used and k not in ("mode", "block", "different_layout_per_head"))
        if unused:
            notes.append(f"{sp}: {', '.join(unused)} not used by mode {sa.mode!r}")
    return problems, notes


def check_rules(cfg: DSConfig, raw: dict[str, Any], prefix: str) -> tuple[list[Problem], list[str]]:
    """Every cross-field rule; (problems, notes). ``raw`` is the migrated input, to see which keys were given."""
    problems: list[Problem] = []
    notes: list[str] = []
    problems += check_precision(cfg, prefix)
    if cfg.data_types.buffer_dtype is not None and cfg.precision == "fp32":
        notes.append(f"{prefix}data_types.buffer_dtype only matters with fp16 or bf16 (DeepSpeed casts buffers only "
                     "there); the fp32 model's buffers keep their dtype")
    zero_problems, zero_notes = check_zero(cfg, raw, prefix)
    problems += zero_problems
    notes += zero_notes
    problems += check_optimizer_rules(cfg, prefix)
    monitor_problems, monitor_notes = check_monitors(cfg, prefix)
    problems += monitor_problems
    notes += monitor_notes
    tool_problems, tool_notes = check_tooling(cfg, raw, prefix)
    problems += tool_problems
    notes += tool_notes
    z = cfg.zero_optimization
    if not z.compute_grad_norm:  # DeepSpeed's fast path has no norm for anything to read: its fail-fast rules
        for wrong, path, hint in (
                (z.stage not in (1, 2), "zero_optimization.stage", "use ZeRO stage 1 or 2"),
                (bool(cfg.gradient_clipping), "gradient_clipping", "set gradient_clipping to 0 (clipping needs the "
                 "norm)"),
                (z.offload_optimizer_device != "none", "zero_optimization.offload_optimizer.device",
                 "offload nothing")):
            if wrong:
                problems.append(Problem(f"{prefix}zero_optimization.compute_grad_norm", f"false does not go with "
                                        f"this {path} (DeepSpeed refuses it too)", hint))
    if not cfg.managed_gradient_accumulation and z.stage == 3 and z.offload_optimizer_device == "nvme":
        problems.append(Problem(f"{prefix}managed_gradient_accumulation", "false is not supported with ZeRO-3 NVMe "
                                "optimizer offload (it closes each step's gradient files at the boundary backward, "
                                "which the caller's step() comes after)", "set it true, or offload to cpu"))
    if cfg.vocabulary_size and cfg.vocabulary_size % 8:  # DeepSpeed's config check says the same
        notes.append(f"{prefix}vocabulary_size {cfg.vocabulary_size} is not a multiple of 8: embeddings and the "
                     "output layer of that width use GPU tensor cores less well (pad the vocabulary to a multiple "
                     "of 8)")
    problems += check_data_efficiency(cfg.data_efficiency, cfg.curriculum_learning, prefix)
    problems += check_compression(cfg.compression_training, prefix)
    problems += check_quantization_modes(cfg.compression_training, cfg.quantize_training, cfg.eigenvalue,
                                         cfg.precision, int(cfg.zero_optimization.stage), prefix)
    return problems, notes
