"""``dsrun.initialize`` and ``dsrun.add_config_arguments``, with DeepSpeed's signatures."""
from __future__ import annotations

import argparse
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from dsrun import comm
from dsrun.features import ModelParameters
from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.engine.engine import DataParallelMpu

# what initialize takes as a client optimizer (model_parameters: dsrun.features.ModelParameters)
ClientOptimizer = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed``, ``--deepspeed_config`` (and the deprecated ``--deepscale``,
    ``--deepscale_config``) to ``parser``; returns it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated: enable DeepSpeed (use --deepspeed)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated: DeepSpeed json configuration file (use --deepspeed_config)")
    return parser


def _resolve_config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is None:
        config = config_params
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        warnings.warn("--deepscale_config is deprecated, use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is not None:
            raise ConfigError(Problem("--deepscale_config", "given together with --deepspeed_config",
                                      "pass only --deepspeed_config"))
        args.deepspeed_config = args.deepscale_config
        args.deepscale_config = None
    args_config = getattr(args, "deepspeed_config", None) if args is not None else None
    if args_config is not None and config is not None:
        raise ConfigError(Problem("initialize(config=...)", "given together with args.deepspeed_config",
                                  "pass the config one way only"))
    source = config if config is not None else args_config
    if source is None:
        raise ConfigError(Problem("initialize(config=...)", "no DeepSpeed config given",
                                  "pass config=<dict or path> or --deepspeed_config <file>"))
    return source


def _mesh_config(source: object, mesh_param: tuple[int, int] | None) -> object:
    """The config with DeepSpeed's ``mesh_param=(data_parallel_size, sequence_parallel_size)`` put in (a dict)."""
    if mesh_param is None:
        return source
    if len(tuple(mesh_param)) != 2:
        raise ConfigError(Problem("initialize(mesh_param=...)", f"got {mesh_param!r}",
                                  "pass (data_parallel_size, sequence_parallel_size)"))
    if not isinstance(source, dict):
        raise ConfigError(Problem("initialize(mesh_param=...)", "needs the config as a dict",
                                  "set data_parallel_size and sequence_parallel_size in the config file instead"))
    dp, sp = (int(n) for n in mesh_param)
    for key, value in (("data_parallel_size", dp), ("sequence_parallel_size", sp)):
        if key in source and int(source[key]) != value:
            raise ConfigError(Problem(key, f"is {source[key]}, but mesh_param sets {value}",
                                      "give the mesh once: drop the key or mesh_param"))
    return {**source, "data_parallel_size": dp, "sequence_parallel_size": sp}


def _data_parallel_world(mpu: object) -> int:
    """The ranks the batch is counted over: the world's, or a client mpu's data-parallel size; DeepSpeed's
    sequence-parallel mpu (``parallel_state_sp``, no data-parallel getters) counts world / its sequence size."""
    from dsrun.sequence.parallel_state_sp import is_sequence_parallel_mpu

    if mpu is None:
        return comm.get_world_size()
    if is_sequence_parallel_mpu(mpu) and not hasattr(mpu, "get_data_parallel_world_size"):
        return comm.get_world_size() // mpu.get_sequence_parallel_world_size()
    return mpu.get_data_parallel_world_size()


def _refuse_pipeline_settings(ds_config: DSConfig) -> None:
    """The ``pipeline`` section drives a PipelineModule's engine; for any other model a non-default value
    would be ignored, so it is refused."""
    section = ds_config.pipeline
    changed = sorted(k for k in section.model_fields_set
                     if getattr(section, k) != type(section).model_fields[k].default)
    if changed:
        raise ConfigError([Problem(f"pipeline.{k}", f"got {getattr(section, k)!r}, but the model is not a "
                                   "PipelineModule", "wrap the model in dsrun.pipe.PipelineModule, or drop the key")
                           for k in changed])


class ModelRequiredError(ConfigError, AssertionError):
    """``initialize`` was given no model: a ConfigError, and also the AssertionError DeepSpeed raises there."""


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: ClientOptimizer | None = None,
               model_parameters: ModelParameters | None = None, training_data: torch.utils.data.Dataset | None = None,
               lr_scheduler: Any = None, distributed_port: int = 29500, mpu: DataParallelMpu | None = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None, config: Any = None,
               mesh_param: tuple[int, int] | None = None, config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """Build the training engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``optimizer`` (an optimizer or a callable on the parameters) overrides the config's; ``lr_scheduler``
    (an object or a callable on the optimizer) overrides the config's; ``training_data`` (a Dataset) gives a
    distributed loader. ``config`` is a dict or a path (``config_params`` is its old name; ``args.deepspeed_config``
    works too). Initializes torch.distributed if needed (gloo on CPU, NCCL on CUDA). ``mesh_param=(dp, sp)`` is
    DeepSpeed's data x sequence mesh: the config's ``data_parallel_size`` and ``sequence_parallel_size``.
    """
    from dsrun.config import (RANK_WORLD_SOURCE, ResolvedDsConfig, announce,  # the config layer, loaded only
                              load_ds_config, typed_config)  # when training starts
    from dsrun.launcher.protocol import install_user_error_hook
    from dsrun.engine.engine import DeepSpeedEngine
    from dsrun.features import Features

    install_user_error_hook()  # under dsrun's launcher: a config mistake is one line, not a traceback per rank
    if model is None:
        slip = isinstance(args, torch.nn.Module)  # initialize(model, ...): DeepSpeed's first parameter is args
        raise ModelRequiredError(Problem(
            "initialize(model=...)", "a model is required" + (", and the first positional argument is args, which "
                                                             "got a torch.nn.Module" if slip else ""),
            "pass model=<torch.nn.Module> by keyword"))
    source = _mesh_config(_resolve_config_source(args, config, config_params), mesh_param)
    if dist_init_required is not False and not comm.is_initialized():
        comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required,
                              verbose=False)
    if comm.is_initialized():  # also a group the script made itself (accelerate does)
        comm.destroy_at_exit()
    # A model that needs its own engine names it (a PipelineModule: dsrun.pipe), and brings its own
    # process grid as the mpu, as deepspeed.initialize does with model.mpu().
    engine_class = model.engine_class() if hasattr(model, "engine_class") else DeepSpeedEngine
    if engine_class is not DeepSpeedEngine:
        if mpu is not None:
            raise ConfigError(Problem("initialize(mpu=...)", f"a {type(model).__name__} brings its own process "
                                      "grid", "leave mpu=None"))
        mpu = model.mpu()
    from dsrun.tensor_parallel import refuse_group_beside_mpu

    refuse_group_beside_mpu(mpu)  # tp_model_init's tp_group and an mpu (DeepSpeed's rule)
    world = _data_parallel_world(mpu)
    if mpu is None:  # AutoTP: the ranks of a tensor-parallel group share their samples (dsrun/tensor_parallel)
        world //= _tensor_parallel_degree(source)
    # dsrun train's rank hands over the config it parsed once (dsrun.config.load_resolved), for its world size
    ds_config = source if hasattr(source, "zero_optimization") else typed_config(source)
    if ds_config is None or (isinstance(source, ResolvedDsConfig) and source.world_size != world):
        ds_config = load_ds_config(source, world_size=world, world_size_source=RANK_WORLD_SOURCE)
    if hasattr(ds_config, "unimplemented"):  # what the run goes without (dsrun_allow_unimplemented), said once
        announce(ds_config, rank=comm.get_rank())
    if engine_class is DeepSpeedEngine:
        _refuse_pipeline_settings(ds_config)
        if ds_config.hybrid_engine.enabled:  # DeepSpeed-Chat's train/generate engine (dsrun/hybrid_engine.py)
            from dsrun.engine.hybrid_engine import DeepSpeedHybridEngine
            engine_class = DeepSpeedHybridEngine
    elif ds_config.hybrid_engine.enabled:
        raise ConfigError(Problem("hybrid_engine.enabled", f"a {type(model).__name__} runs its own engine",
                                  "drop hybrid_engine for a pipeline model"))
    engine_class.prepare_model(model, ds_config)
    features = Features.build(ds_config)  # dsrun/features.py: each wraps the model before the optimizer
    model, model_parameters = features.wrap_model(model, model_parameters, optimizer)
    params = model_parameters if model_parameters is not None else model.parameters()
    if not isinstance(optimizer, torch.optim.Optimizer):
        params = features.optimizer_params(model, params)  # MoE: experts in param groups of their own
    base_optimizer = build_engine_optimizer(ds_config, optimizer, params)
    engine = engine_class(model=model, config=ds_config, optimizer=base_optimizer, lr_scheduler=lr_scheduler,
                          training_data=training_data, collate_fn=collate_fn, mpu=mpu, raw_config=source,
                          features=features)
    engine.client_optimizer = base_optimizer if optimizer is not None else None
    engine.features.attach(engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _tensor_parallel_degree(source: Any) -> int:
    """The AutoTP degree the config (or ``deepspeed.tp_model_init``) asks for, read before the batch arithmetic
    (which counts data-parallel ranks only)."""
    from dsrun.config import typed_config
    from dsrun.config.sources import read_config_source
    from dsrun.tensor_parallel import autotp_degree

    typed = source if hasattr(source, "zero_optimization") else typed_config(source)
    if typed is not None:
        return autotp_degree(int(typed.tensor_parallel.autotp_size))
    # the raw key, not a second parse of the whole config (the batch arithmetic's parse comes next)
    section = read_config_source(source).get("tensor_parallel")
    size = section.get("autotp_size") if isinstance(section, dict) else None
    return autotp_degree(int(size) if isinstance(size, (int, float)) and not isinstance(size, bool) else 0)


def build_engine_optimizer(config: DSConfig, optimizer: ClientOptimizer | None, params: ModelParameters
                           ) -> torch.optim.Optimizer | None:
    """The optimizer the engine will step: a client optimizer (object, or callable on ``params``) wins
    over the config's ``optimizer`` section."""
    from dsrun.accelerator import get_accelerator
    from dsrun.optim import build_optimizer
    from dsrun.optim.onebit import ONE_BIT_CLASSES, build_onebit_optimizer

    if optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if callable(optimizer):
            return optimizer(params)
        raise ConfigError(Problem("initialize(optimizer=...)", f"got {type(optimizer).__name__}; allowed: a "
                                  "torch.optim.Optimizer or a callable returning one"))
    if config.optimizer is not None and config.optimizer.type:
        if config.optimizer.type.lower() in ONE_BIT_CLASSES:  # they communicate by themselves: docs/onebit.md
            return build_onebit_optimizer(config.optimizer.type, params, config.optimizer.params)
        on_cpu = get_accelerator().name == "cpu"
        offload = config.zero_optimization.offload_optimizer.device != "none" and config.zero_optimization.stage > 0
        return build_optimizer(config.optimizer.type, params, config.optimizer.params, on_cpu=on_cpu or offload,
                               offload=offload)
    return None

