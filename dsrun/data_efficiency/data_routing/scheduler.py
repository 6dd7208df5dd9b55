"""The random-LTD schedule: how many tokens the random-LTD layers keep at each step, and the layer-tokens used.

DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.scheduler.RandomLTDScheduler``. The kept length
grows linearly from ``min_value`` to ``max_value`` over ``require_steps`` steps, always a multiple of
``seq_per_step`` (:func:`~dsrun.data_efficiency.curriculum_scheduler.root_schedule_value` with root 1).
Once per optimizer step (the engine calls :meth:`update_seq` in every training forward with the step number;
repeated calls within a step count once) the consumed layer-tokens grow by
``global_batch · (kept · random_ltd_layer_num + max_value · (total_layer_num − random_ltd_layer_num))``:
the random-LTD layers see the kept tokens, the others the full ``max_value``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from dsrun.data_efficiency.curriculum_scheduler import root_schedule_value, section_dict

if TYPE_CHECKING:
    from dsrun.config.base import Section

MIN_VALUE, MAX_VALUE, CURRENT_VALUE = "min_value", "max_value", "current_value"
CONSUMED_LAYER_TOKENS, CURRENT_STEP = "consumed_layer_tokens", "current_steps"


class RandomLTDScheduler:
    """Built from the ``random_ltd`` section (a dict or the typed section) plus ``global_batch_size``."""

    def __init__(self, config: Mapping[str, Any] | Section, global_batch_size: int | None = None):
        config = section_dict(config)
        self.model_layer_num = int(config["total_layer_num"])
        self.random_ltd_layer_num = int(config["random_ltd_layer_num"])
        self.config_schedule = section_dict(config["random_ltd_schedule"])
        self.global_batch_size = int(global_batch_size if global_batch_size is not None
                                     else config["global_batch_size"])
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        schedule = self.config_schedule
        self.state.update({MIN_VALUE: schedule[MIN_VALUE], MAX_VALUE: schedule[MAX_VALUE],
                           CURRENT_VALUE: schedule[MIN_VALUE], "schedule_config": dict(schedule["schedule_config"]),
                           "schedule_type": schedule.get("schedule_type", "fixed_linear"),
                           CONSUMED_LAYER_TOKENS: 0, CURRENT_STEP: -1})

    def get_value(self, global_steps: int) -> int:
        """The kept length the schedule gives at ``global_steps``."""
        config = self.state["schedule_config"]
        return root_schedule_value(global_steps, config["require_steps"], self.state[MIN_VALUE],
                                   self.state[MAX_VALUE], config["seq_per_step"], 1)

    def get_current_seq(self) -> int:
        return self.state[CURRENT_VALUE]

    def set_current_seq(self, seq_length: int) -> None:
        self.state[CURRENT_VALUE] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def layer_tokens_per_step(self, kept: int) -> int:
        """Layer-tokens of one optimizer step when the random-LTD layers keep ``kept`` tokens."""
        return self.global_batch_size * (kept * self.random_ltd_layer_num
                                         + self.state[MAX_VALUE] * (self.model_layer_num - self.random_ltd_layer_num))

    def update_seq(self, global_steps: int) -> None:
        """Move to the schedule's kept length at ``global_steps`` and count that step's layer-tokens once."""
        if self.state[CURRENT_VALUE] < self.state[MAX_VALUE]:
            self.state[CURRENT_VALUE] = self.get_value(global_steps)
        if global_steps != self.state[CURRENT_STEP]:
            self.state[CONSUMED_LAYER_TOKENS] += self.layer_tokens_per_step(self.state[CURRENT_VALUE])
            self.state[CURRENT_STEP] = global_steps

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """The layer-tokens ``train_iters`` steps consume from here (advances this scheduler, as DeepSpeed's)."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[CONSUMED_LAYER_TOKENS]

    def state_dict(self) -> dict[str, Any]:
        return {key: self.state[key] for key in (CONSUMED_LAYER_TOKENS, CURRENT_STEP, CURRENT_VALUE, MIN_VALUE,
                                                 MAX_VALUE)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for key in (CONSUMED_LAYER_TOKENS, CURRENT_STEP, CURRENT_VALUE, MIN_VALUE, MAX_VALUE):
            self.state[key] = state_dict[key]
