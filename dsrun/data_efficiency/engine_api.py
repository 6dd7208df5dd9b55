"""DeepSpeed's data-efficiency engine methods, a part of :class:`dsrun.engine.engine.DeepSpeedEngine` that
carries each of them as a one-line delegation (``engine_getters.facade``).

They read the engine's typed config and its :class:`~dsrun.data_efficiency.features.DataEfficiency`
feature (``engine.data_efficiency``); the logic lives in this package, the engine only calls the seams.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from torch import nn

from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from dsrun.config import DSConfig

    from .features import DataEfficiency


class _Engine(Protocol):
    """What these methods read of the engine that holds them."""

    _config: DSConfig
    data_efficiency: DataEfficiency
    module: nn.Module
    training_dataloader: Any  # the engine's loader (DeepSpeed's attribute): whatever deepspeed_io built


class DataEfficiencyMethods:
    """``set_custom_curriculum_learning_schedule``, ``get_pld_theta``, ``random_ltd_initialize``,
    ``set_data_post_process_func`` and the data-efficiency config getters, with DeepSpeed's names."""

    def __init__(self, engine: _Engine):
        self._engine = engine

    # --- config getters -------------------------------------------------------------------------------
    def curriculum_enabled_legacy(self) -> bool:
        return self._engine.data_efficiency.curriculum_scheduler_legacy is not None

    def curriculum_params_legacy(self) -> dict[str, Any]:
        return self._engine._config.curriculum_learning.model_dump(exclude_none=True)

    def data_efficiency_enabled(self) -> bool:
        return bool(self._engine._config.data_efficiency.enabled)

    def data_efficiency_config(self) -> dict[str, Any]:
        return self._engine._config.data_efficiency.model_dump(exclude_none=True)

    def data_sampling_enabled(self) -> bool:
        return bool(self._engine._config.data_efficiency.enabled and self._engine._config.data_efficiency.data_sampling.enabled)

    def data_sampling_config(self) -> dict[str, Any]:
        return self._engine._config.data_efficiency.data_sampling.model_dump(exclude_none=True)

    def curriculum_learning_enabled(self) -> bool:
        return self._engine.data_efficiency.sampling_enabled

    def curriculum_learning_config(self) -> dict[str, Any]:
        return self._engine._config.data_efficiency.data_sampling.curriculum_learning.model_dump(exclude_none=True)

    def random_ltd_enabled(self) -> bool:
        return self._engine.data_efficiency.random_ltd_enabled

    def random_ltd_config(self) -> dict[str, Any]:
        return self._engine._config.data_efficiency.data_routing.random_ltd.model_dump(exclude_none=True)

    def pld_enabled(self) -> bool:
        return self._engine.data_efficiency.progressive_layer_drop is not None

    def pld_params(self) -> dict[str, Any]:
        pld = self._engine._config.progressive_layer_drop
        return {"theta": pld.theta, "gamma": pld.gamma}

    def pld_theta(self) -> float:
        return float(self._engine._config.progressive_layer_drop.theta)

    def pld_gamma(self) -> float:
        return float(self._engine._config.progressive_layer_drop.gamma)

    # --- behaviour -------------------------------------------------------------------------------------
    def get_pld_theta(self) -> float | None:
        """PLD's current global keep probability θ(t) (None when PLD is off)."""
        pld = self._engine.data_efficiency.progressive_layer_drop
        return pld.get_theta() if pld is not None else None

    def random_ltd_initialize(self) -> None:
        """Attach the random-LTD schedule to the converted layers ``random_ltd_layer_id`` names (called by
        ``convert_to_random_ltd``)."""
        self._engine.data_efficiency.initialize_random_ltd(self._engine.module)

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], int]]
                                                | Callable[[int], int]) -> None:
        """The pacing functions of ``custom`` schedules: ``{metric_name: fn(global_step) -> difficulty}`` for
        the data sampler's metrics (DeepSpeed's form); for the legacy ``curriculum_learning`` section, a
        function or ``{"seqlen": fn}``."""
        features = self._engine.data_efficiency
        applied = False
        loader = features.training_dataloader
        if loader is not None and isinstance(schedule_func_dict, Mapping):
            loader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)
            applied = True
        legacy = features.curriculum_scheduler_legacy
        if legacy is not None:
            fn = schedule_func_dict if callable(schedule_func_dict) else schedule_func_dict.get(
                features.curriculum_params_legacy.curriculum_type)
            if fn is not None:
                legacy.set_custom_get_difficulty(fn)
                applied = True
        if not applied:
            raise ConfigError(Problem("set_custom_curriculum_learning_schedule", "there is no curriculum to apply "
                                      "it to (neither curriculum_learning nor data_sampling.curriculum_learning is "
                                      "enabled with a loader from initialize(training_data=...))",
                                      "enable a curriculum with schedule_type 'custom'"))

    def set_data_post_process_func(self, post_process_func: Callable[[Any, dict[str, Any]], Any]) -> None:
        """``post_process_func(batch, data_sampler_state)`` runs on every batch of the training loader (e.g. a
        seqlen curriculum's truncation; the state holds ``current_difficulties``)."""
        if self._engine.training_dataloader is not None:
            self._engine.training_dataloader.post_process_func = post_process_func
