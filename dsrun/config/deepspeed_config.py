"""``deepspeed.runtime.config``: DeepSpeed's config object, with its flat attribute names, over dsrun's schema.

``DeepSpeedConfig(config, mpu=None)`` reads a dict, a JSON/hjson/YAML path, JSON text or base64 JSON through
:func:`dsrun.config.load_ds_config` (validation, legacy-key migration, batch arithmetic), with the data-parallel
size taken from torch.distributed when it is initialized (divided by the ``mpu``'s model-parallel size), and
exposes the attributes DeepSpeed's engine and client code read (``train_batch_size``, ``zero_optimization_stage``,
``fp16_enabled``, ``bfloat16_enabled``, ``optimizer_name`` ...). ``config`` holds the typed
:class:`dsrun.config.DSConfig`; ``_param_dict`` the dict as given.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Protocol

from dsrun.config import DSConfig
from dsrun.config import load_ds_config
from dsrun.config.batch import resolve_batch
from dsrun.config.sources import read_config_source
from dsrun.config.monitoring import DeepSpeedMonitorConfig
from dsrun.config.expert_parallel import parse_autoep_config
from dsrun.utils.errors import ConfigError


class ModelParallelUnit(Protocol):
    """Megatron's ``mpu`` as DeepSpeed's config reads it (``get_model_parallel_world_size``, when it has one)."""

# DeepSpeed's optimizer names (the lower-cased "optimizer.type" values)
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"  # DeepSpeed 0.18+ (dsrun/optim/muon)
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
                        ONEBIT_LAMB_OPTIMIZER, ZERO_ONE_ADAM_OPTIMIZER, LION_OPTIMIZER]

# DeepSpeed's raw top-level keys and defaults that its getters below read (deepspeed.runtime.constants)
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = None  # None: the engine leaves the DeepSpeed logger's level as it is
GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = DSConfig.model_fields["gradient_clipping"].default  # 1.0, as DeepSpeed 0.19


def get_log_level(param_dict: dict) -> str | None:
    """The config dict's ``log_level`` as written (DeepSpeed's raw getter: no validation), None when absent."""
    return param_dict.get(LOG_LEVEL, LOG_LEVEL_DEFAULT)


def get_gradient_clipping(param_dict: dict) -> float:
    """The config dict's ``gradient_clipping`` as written, 1.0 when absent (DeepSpeed's raw getter)."""
    return param_dict.get(GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)


#: DeepSpeed raises this for a config it cannot use; dsrun's ConfigError (also a ValueError) lists every problem.
DeepSpeedConfigError = ConfigError


def _world_size(mpu: ModelParallelUnit | None) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    world = dist.get_world_size()
    if mpu is not None and hasattr(mpu, "get_model_parallel_world_size"):
        world //= mpu.get_model_parallel_world_size()
    return world


class DeepSpeedConfig:
    """DeepSpeed's ``DeepSpeedConfig(config, mpu=None, mesh_device=None)``; see the module docstring."""

    def __init__(self, config: str | dict | Path, mpu: ModelParallelUnit | None = None,
                 mesh_device: object = None):
        self._param_dict = copy.deepcopy(read_config_source(config))
        self.world_size = _world_size(mpu)
        self.config: DSConfig = load_ds_config(self._param_dict, self.world_size,
                                                  world_size_source="torch.distributed")
        c = self.config
        self.train_batch_size = c.train_batch_size
        self.train_micro_batch_size_per_gpu = c.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = c.gradient_accumulation_steps
        self.steps_per_print = c.steps_per_print
        self.dump_state = c.dump_state
        self.gradient_clipping = c.gradient_clipping
        self.prescale_gradients = c.prescale_gradients
        self.gradient_predivide_factor = c.gradient_predivide_factor
        self.gradient_allreduce_op = c.gradient_allreduce_op
        self.torch_autocast_enabled = c.torch_autocast.enabled
        self.sparse_gradients_enabled = c.sparse_gradients
        self.communication_data_type = c.communication_data_type
        self.zero_config = c.zero_optimization
        self.zero_optimization_stage = c.zero_optimization.stage
        self.zero_enabled = c.zero_optimization.stage > 0
        self.zero_allow_untested_optimizer = c.zero_allow_untested_optimizer
        self.fp16_enabled = c.fp16.enabled
        self.bfloat16_enabled = c.bf16.enabled
        self.amp_enabled = c.amp.enabled
        self.loss_scale = c.fp16.loss_scale
        self.initial_dynamic_scale = 2 ** c.fp16.initial_scale_power
        self.optimizer_name = c.optimizer.type.lower() if c.optimizer.type else None
        self.optimizer_params = c.optimizer.params if c.optimizer.type else None
        self.scheduler_name = c.scheduler.type if c.scheduler.type else None
        self.scheduler_params = c.scheduler.params if c.scheduler.type else None
        self.wall_clock_breakdown = c.wall_clock_breakdown
        self.memory_breakdown = c.memory_breakdown
        self.elasticity_enabled = c.elasticity.enabled
        self.dataloader_drop_last = c.dataloader_drop_last
        self.activation_checkpointing_config = c.activation_checkpointing
        self.flops_profiler_config = c.flops_profiler
        # AutoEP's section, parsed as DeepSpeed parses it (a load_balance_coeff other than null: ValueError)
        self.expert_parallel_config = parse_autoep_config(self._param_dict.get("expert_parallel") or {})
        self.monitor_config = DeepSpeedMonitorConfig(tensorboard=c.tensorboard, wandb=c.wandb,
                                                     csv_monitor=c.csv_monitor, comet=c.comet)

    def _configure_train_batch_size(self) -> None:
        """DeepSpeed's batch arithmetic over the three attributes as they are now (a caller may have set any to
        None): fills in the missing ones as :func:`dsrun.config.batch.resolve_batch` does and raises
        AssertionError, as DeepSpeed's bare asserts do, where they cannot be made consistent."""
        resolved, problems = resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                           self.gradient_accumulation_steps, self.world_size, "torch.distributed")
        if problems:
            raise AssertionError("; ".join(str(problem) for problem in problems))
        self.train_batch_size = resolved.train_batch_size
        self.train_micro_batch_size_per_gpu = resolved.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = resolved.gradient_accumulation_steps

    def print(self, name: str) -> None:
        """Log every setting, as DeepSpeed's ``DeepSpeedConfig.print`` does."""
        from dsrun.utils.logging import logger

        logger.info("%s:", name)
        for key, value in sorted(self.config.to_ds_dict().items()):
            logger.info("  %s %s", key.ljust(29, "."), value)
