"""The one table of DeepSpeed's module paths: ``deepspeed.X`` -> the dsrun module that serves it.

dsrun's tree is drawn by its own concerns (docs/architecture.md), not by DeepSpeed's module tree, so DeepSpeed's
paths are served from here. The longest matching prefix wins, and the rest of the path follows it
(``deepspeed.runtime.zero.stage3`` is ``dsrun.zero.stage3``); a path with no entry is the same path under dsrun
(``deepspeed.comm.comm`` is ``dsrun.comm.comm``). DeepSpeed-named modules that only re-export live in
``dsrun/compat/``, which mirrors DeepSpeed's tree. The served module is dsrun's own object, not a copy.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

ALIAS = "deepspeed"
TARGET = "dsrun"

PATHS: dict[str, str] = {
    # the runtime package: its rooms have their own top-level folders in dsrun
    "deepspeed.runtime": "dsrun.compat.runtime",
    "deepspeed.runtime.engine": "dsrun.engine.engine",
    "deepspeed.runtime.engine_collectives": "dsrun.engine.engine_collectives",
    "deepspeed.runtime.engine_getters": "dsrun.engine.engine_getters",
    "deepspeed.runtime.engine_methods": "dsrun.engine.engine_methods",
    "deepspeed.runtime.initialize": "dsrun.engine.initialize",
    "deepspeed.runtime.observer": "dsrun.engine.observer",
    "deepspeed.runtime.direct_backward": "dsrun.engine.direct_backward",
    "deepspeed.runtime.dataloader": "dsrun.engine.dataloader",
    "deepspeed.runtime.sparse_tensor": "dsrun.engine.sparse_tensor",
    "deepspeed.runtime.autotuning_probe": "dsrun.engine.autotuning_probe",
    "deepspeed.runtime.config": "dsrun.config.deepspeed_config",
    "deepspeed.runtime.config_utils": "dsrun.config.config_utils",
    "deepspeed.runtime.timers": "dsrun.profiling.timers",
    "deepspeed.runtime.lr_schedules": "dsrun.optim.lr_schedules",
    "deepspeed.runtime.optimizer_wrappers": "dsrun.optim.optimizer_wrappers",
    "deepspeed.runtime.precision": "dsrun.precision.strategy",
    "deepspeed.runtime.precision_config": "dsrun.precision.config",
    "deepspeed.runtime.torch_autocast": "dsrun.precision.torch_autocast",
    "deepspeed.runtime.fp16": "dsrun.compat.runtime.fp16",
    "deepspeed.runtime.fp16.loss_scaler": "dsrun.precision.loss_scaler",
    "deepspeed.runtime.fp16.onebit": "dsrun.optim.onebit",
    "deepspeed.runtime.zero": "dsrun.zero",
    "deepspeed.runtime.zero.partition_parameters": "dsrun.zero.init",
    "deepspeed.compile.z3_eager_fallback": "dsrun.zero.eager_fallback",
    "deepspeed.compile.init_z3": "dsrun.compile.init",
    "deepspeed.runtime.domino": "dsrun.tensor_parallel.domino",
    "deepspeed.compile.init_tp": "dsrun.tensor_parallel.compile_pass",
    "deepspeed.compile.passes.tp_compile": "dsrun.tensor_parallel.compile_pass",
    "deepspeed.compile.custom_ops": "dsrun.compat.compile.custom_ops",
    "deepspeed.compile.passes.sp_compile": "dsrun.compile.autosp",
    "deepspeed.compile.custom_ops.sp_dp_registry": "dsrun.compile.sp_mesh",
    "deepspeed.compile.custom_ops.tp_collectives": "dsrun.tensor_parallel.graph_collectives",
    "deepspeed.runtime.zero.stage_1_and_2": "dsrun.compat.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.mics": "dsrun.compat.runtime.zero.mics",
    "deepspeed.runtime.zero.leaf_module_config": "dsrun.compat.runtime.zero.leaf_module_config",
    "deepspeed.runtime.zero.utils": "dsrun.compat.runtime.zero.utils",
    "deepspeed.runtime.zero.muon": "dsrun.optim.muon",
    "deepspeed.runtime.zero.muon.original_muon": "dsrun.optim.muon.optimizer",
    "deepspeed.runtime.zero.muon.muon_optimizer": "dsrun.optim.muon.optimizer",
    "deepspeed.ops.lamb": "dsrun.compat.ops.lamb",
    "deepspeed.runtime.offload": "dsrun.offload",
    "deepspeed.runtime.activation_checkpointing": "dsrun.activation_checkpointing",
    "deepspeed.runtime.activation_checkpointing.checkpointing": "dsrun.activation_checkpointing.api",
    "deepspeed.runtime.pipe": "dsrun.pipe",
    "deepspeed.runtime.data_pipeline": "dsrun.data_efficiency",
    "deepspeed.checkpoint.reshape_utils": "dsrun.checkpoint.reshape_map",
    "deepspeed.checkpoint.reshape_meg_2d": "dsrun.checkpoint.reshape_map",
    "deepspeed.checkpoint.reshape_3d_utils": "dsrun.checkpoint.reshape_map",
    "deepspeed.checkpoint.zero_checkpoint": "dsrun.checkpoint.deepspeed_checkpoint",
    "deepspeed.checkpointing": "dsrun.activation_checkpointing.api",
    "deepspeed.utils.groups": "dsrun.compat.utils.groups",
    "deepspeed.comm.torch": "dsrun.comm.torch_backend",
    "deepspeed.runtime.comm.coalesced_collectives": "dsrun.comm.coalesced",
    "deepspeed.utils.z3_leaf_module": "dsrun.utils.leaf_modules",
    "deepspeed.runtime.python_gc": "dsrun.utils.python_gc",
    "deepspeed.utils.torch": "dsrun.utils.torch_version",
    "deepspeed.utils.comms_logging": "dsrun.comm.logger",
    "deepspeed.utils.timer": "dsrun.compat.utils.timer",
    "deepspeed.module_inject": "dsrun.compat.module_inject",
    # AutoEP (issue 43): its one room is dsrun/autoep/
    "deepspeed.module_inject.auto_ep": "dsrun.autoep.detect",
    "deepspeed.module_inject.auto_ep_config": "dsrun.autoep.config",
    "deepspeed.module_inject.auto_ep_layer": "dsrun.autoep.layer",
    "deepspeed.module_inject.auto_ep_folding": "dsrun.autoep.folding",
    "deepspeed.module_inject.auto_ep_preset_adapters": "dsrun.autoep.presets",
    "deepspeed.module_inject.auto_ep_presets": "dsrun.autoep.presets",
    "deepspeed.module_inject.auto_ep_presets.base": "dsrun.autoep.presets.adapters",
    "deepspeed.module_inject.auto_ep_presets.registry": "dsrun.autoep.presets",
    "deepspeed.module_inject.auto_ep_presets.mixtral": "dsrun.autoep.presets.families",
    "deepspeed.module_inject.auto_ep_presets.qwen3_moe": "dsrun.autoep.presets.families",
    "deepspeed.module_inject.auto_ep_presets.qwen3_5_moe": "dsrun.autoep.presets.families",
    "deepspeed.module_inject.auto_ep_presets.deepseek_v2": "dsrun.autoep.presets.families",
    "deepspeed.module_inject.auto_ep_presets.deepseek_v3": "dsrun.autoep.presets.families",
    "deepspeed.moe.ep_count": "dsrun.autoep.router",
    "deepspeed.moe.ep_router": "dsrun.autoep.router",
    "deepspeed.moe.ep_experts": "dsrun.autoep.experts",
    "deepspeed.moe.ep_kernels": "dsrun.autoep.experts",
    "deepspeed.moe.ep_repack": "dsrun.autoep.repack",
    "deepspeed.moe.ep_tp_dispatch": "dsrun.autoep.ep_tp_dispatch",
    "deepspeed.moe.fused_expert_layout": "dsrun.autoep.repack",
    "deepspeed.autotuning.autotuner": "dsrun.autotuning.deepspeed_api",
    "deepspeed.autotuning.scheduler": "dsrun.autotuning.deepspeed_api",
    "deepspeed.autotuning.utils": "dsrun.autotuning.deepspeed_api",
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": "dsrun.sequence.parallel_state_sp",
    "deepspeed.sequence.autosp_detector": "dsrun.sequence.auto_sp",
    "deepspeed.sequence.fpdt_layer": "dsrun.sequence.fpdt",
    "deepspeed.runtime.rollout.base": "dsrun.inference.rollout",
    "deepspeed.runtime.rollout.hybrid_engine_rollout": "dsrun.inference.rollout",
    "deepspeed.runtime.hybrid_engine_graph": "dsrun.inference.decode_graphs",
    "deepspeed.runtime.hybrid_engine": "dsrun.engine.hybrid_engine",
    # inference v2 (FastGen): EXAONE 4.0 and 4.5 share one module, as do the two model bases
    "deepspeed.inference.v2.model_implementations.exaone4": "dsrun.inference.v2.model_implementations.exaone",
    "deepspeed.inference.v2.model_implementations.exaone4_5": "dsrun.inference.v2.model_implementations.exaone",
    "deepspeed.inference.v2.model_implementations.inference_model_base":
    "dsrun.inference.v2.model_implementations.inference_transformer_base",
    "deepspeed.inference.v2.modules.module_registry": "dsrun.inference.v2.modules.ds_module",
    # v1 inference kernels: DeepSpeed's one module per op class are one module here, its NHWC bias add a kernel
    "deepspeed.ops.transformer.inference.op_binding.base": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.bias_add": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.bias_gelu": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.bias_relu": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.gated_activation": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.layer_norm": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.moe_res_matmul": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.pre_rms_norm": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.rms_norm": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.residual_add": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.op_binding.vector_add": "dsrun.ops.transformer.inference.op_binding",
    "deepspeed.ops.transformer.inference.bias_add": "dsrun.ops.transformer.inference.kernels",
    # v1 kernel injection: the injected layer (one class per family, one module), the policies (DeepSpeed's policy,
    # replace_policy and the containers' policy classes), the replacement
    "deepspeed.model_implementations": "dsrun.inference.injection",
    "deepspeed.model_implementations.transformers": "dsrun.inference.injection",
    **{f"deepspeed.model_implementations.transformers.{name}": "dsrun.inference.injection.layer"
       for name in ("ds_transformer", "ds_gpt", "ds_bert", "ds_opt", "ds_llama2", "ds_megatron_gpt")},
    "deepspeed.module_inject.replace_module": "dsrun.inference.injection.replace",
    "deepspeed.ops.transformer.inference.ds_attention": "dsrun.inference.injection.attention",
    "deepspeed.ops.transformer.inference.ds_mlp": "dsrun.inference.injection.mlp",
    "deepspeed.module_inject.policy": "dsrun.inference.injection.policies",
    "deepspeed.module_inject.replace_policy": "dsrun.inference.injection.policies",
    "deepspeed.module_inject.containers": "dsrun.inference.injection.policies",
    "deepspeed.ops.fp_quantizer.fp8_gemm": "dsrun.ops.fp_quantizer.quantize",
    # DeepSpeed's Triton ops, as torch: its availability check and SwiGLU modules are the package itself
    "deepspeed.ops.triton_ops._triton": "dsrun.ops.triton_ops",
    "deepspeed.ops.triton_ops.swiglu_triton": "dsrun.ops.triton_ops",
    # DeepSpeed-Inference's group-wise weight quantization: its three modules are one here
    "deepspeed.inference.quantization.utils": "dsrun.inference.quantization.groupwise",
    "deepspeed.inference.quantization.layers": "dsrun.inference.quantization.groupwise",
    "deepspeed.inference.quantization.quantization": "dsrun.inference.quantization.groupwise",
    # dsrun keeps these objects under another name
    "deepspeed.ops.op_builder": "op_builder",
    "deepspeed.launcher.runner": "dsrun.cli.deepspeed_runner",
    "deepspeed.monitor.wandb": "dsrun.monitor.wandb_monitor",
    "deepspeed.monitor.comet": "dsrun.monitor.comet_monitor",
    "deepspeed.monitor.config": "dsrun.config.monitoring",
}
_LONGEST_FIRST = sorted(PATHS, key=len, reverse=True)


def target_of(fullname: str) -> str | None:
    """The dsrun module that serves ``fullname`` (a ``deepspeed.*`` path), or None if it is not an alias path."""
    if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
        return None
    for source in _LONGEST_FIRST:
        if fullname == source or fullname.startswith(source + "."):
            return PATHS[source] + fullname[len(source):]
    return TARGET + fullname[len(ALIAS):]


def children_elsewhere(deepspeed_name: str) -> list[str]:
    """The table's entries directly below ``deepspeed_name`` (their module is not a child of its dsrun module)."""
    return [source for source in PATHS if source.rpartition(".")[0] == deepspeed_name]


def compat_attribute(deepspeed_name: str, attribute: str) -> ModuleType:
    """``deepspeed_name.attribute`` as a module, for the ``__getattr__`` of a compat package (so that
    ``import dsrun as deepspeed; deepspeed.runtime.lr_schedules`` works without the import hook)."""
    target = target_of(f"{deepspeed_name}.{attribute}")
    if target is None or attribute.startswith("__") or importlib.util.find_spec(target) is None:
        raise AttributeError(f"module {deepspeed_name!r} (dsrun) has no attribute {attribute!r}")
    return importlib.import_module(target)
