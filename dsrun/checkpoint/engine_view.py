"""What the checkpoint code reads of the engine and its ZeRO strategy: two Protocols, so this room (below the
engine and ZeRO in docs/architecture.md) types its seams without importing them."""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch import nn

from dsrun.comm.comm import ProcessGroup
from dsrun.features import Features
from dsrun.optim.rank_state import RangeRead

from .layout import CheckpointLayout

if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.precision.strategy import PrecisionStrategy


class CheckpointStrategy(Protocol):
    """A ZeRO strategy (``dsrun.zero.base.ZeroStrategy``) as checkpoints see it: its state, its layout of files
    and masters, and the per-rank optimizer state."""

    stage: int
    masters: list[torch.Tensor]
    deepspeed_wrapper: str | None
    param_alignment_paddings: list[list[int]] | None  # zero_optimization.parameter_alignment's gaps, per master

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def checkpoint_layout(self) -> CheckpointLayout: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...

    def checkpoint_param_shapes(self) -> list["OrderedDict[str, torch.Size]"]: ...

    def master_partitions(self) -> list[tuple[int, int, ProcessGroup]]: ...

    def full_param_value(self, param: nn.Parameter) -> torch.Tensor: ...

    def frozen_param_fragments(self) -> tuple[dict[str, torch.Size], dict[str, torch.Tensor]]: ...

    def frozen_param_messages(self) -> dict[str, torch.Tensor]: ...

    def rank_state_dict(self) -> dict[str, Any] | None: ...

    def load_rank_state_dicts(self, states: list[dict[str, Any]], read: RangeRead = ...) -> None: ...


class CheckpointEngine(Protocol):
    """The engine (``DeepSpeedEngine`` or ``PipelineEngine``) as ``engine_io`` and ``experts`` read it."""

    module: nn.Module
    strategy: CheckpointStrategy | None
    features: Features
    precision: "PrecisionStrategy"
    _config: "DSConfig"
    lr_scheduler: Any  # the client's or the config's scheduler (DeepSpeed's; any object with state_dict)
    training_dataloader: object | None
    global_rank: int
    local_rank: int
    world_size: int
    dp_world_size: int
    dp_group: ProcessGroup
    groups: Any  # dsrun.comm.ProcessGroups: a tensor-parallel rank (the model axis) writes its own files
    device: torch.device
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    loaded_checkpoint_dp_world_size: int
    loaded_checkpoint_mp_world_size: int

    def bfloat16_enabled(self) -> bool: ...

    def gradient_clipping(self) -> float: ...

    def zero_optimization_stage(self) -> int: ...

    def zero_elastic_checkpoint(self) -> bool: ...

    def train_batch_size(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...

    def restore_frozen_shards(self, checkpoint: dict[str, Any]) -> None: ...

    def restore_masters_from_model(self) -> None: ...

    def load_module_state_dict(self, checkpoint: dict[str, Any], strict: bool = True,
                               custom_load_fn: Callable[..., Any] | None = None, fetch_z3_params: bool = False
                               ) -> None: ...
