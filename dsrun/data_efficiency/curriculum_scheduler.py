"""The curriculum pacing function: which maximum difficulty to use at a given step.

DeepSpeed's ``deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler``, used both by the
legacy top-level ``curriculum_learning`` section (difficulty = the sequence length) and by every metric of
``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics``. The schedules, with ``s`` the step,
``T = total_curriculum_step``, ``r = root_degree`` and ``d = difficulty_step``:

- ``fixed_root``: ``v = floor((s / T) ** (1 / r) * (max - min) + min)``, then ``v - v % d``, capped at ``max``;
- ``fixed_linear``: ``fixed_root`` with ``r = 1``;
- ``fixed_discrete``: ``difficulty[i]`` for the first ``i`` with ``s <= max_step[i]``, the last difficulty after
  the last ``max_step``;
- ``custom``: a function of the step the user sets with ``set_custom_get_difficulty`` (the engine's
  ``set_custom_curriculum_learning_schedule``).

``update_difficulty(step)`` moves the current difficulty only while it is below ``max_difficulty`` (so a
schedule that has reached the end stays there), as DeepSpeed does. The values are computed with the same
floating-point expression as DeepSpeed's, so they agree at every step, including where the rounding to
``difficulty_step`` decides.
"""
from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from dsrun.config.base import Section

MIN_DIFFICULTY, MAX_DIFFICULTY = "min_difficulty", "max_difficulty"
CURRENT_DIFFICULTY, SCHEDULE_TYPE, SCHEDULE_CONFIG = "current_difficulty", "schedule_type", "schedule_config"
SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
_NEEDS = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
          "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
          "fixed_discrete": ("difficulty", "max_step"), "custom": ()}


def section_dict(config: Mapping[str, Any] | Section) -> dict[str, Any]:
    """A config section as a plain dict: typed sections (pydantic) lose their unset (None) keys."""
    if hasattr(config, "model_dump"):
        return config.model_dump(exclude_none=True)
    return {k: v for k, v in dict(config).items() if v is not None}


def root_schedule_value(step: int, total_steps: int, low: int, high: int, multiple: int,
                        root_degree: float = 1) -> int:
    """DeepSpeed's fixed_root value at ``step`` (fixed_linear is ``root_degree=1``): see the module docstring.
    The random-LTD schedule uses the same expression with its own names."""
    value = (float(step) / total_steps) ** (1.0 / root_degree)
    value = math.floor(value * (high - low) + low)
    value -= value % multiple
    return min(value, high)


class CurriculumScheduler:
    """One curriculum schedule; ``config`` is a ``curriculum_learning`` section or a metric's section (a dict
    or the typed section) with ``min_difficulty``, ``max_difficulty``, ``schedule_type`` and, except for
    ``custom``, ``schedule_config``."""

    def __init__(self, config: Mapping[str, Any] | Section, path: str = "curriculum_learning"):
        config = section_dict(config)
        problems = [Problem(f"{path}.{key}", "required for a curriculum schedule")
                    for key in (MIN_DIFFICULTY, MAX_DIFFICULTY, SCHEDULE_TYPE) if config.get(key) is None]
        kind = config.get(SCHEDULE_TYPE)
        if kind is not None and kind not in SCHEDULE_TYPES:
            problems.append(Problem(f"{path}.schedule_type", f"got {kind!r}; allowed: {', '.join(SCHEDULE_TYPES)}"))
        schedule = dict(config.get(SCHEDULE_CONFIG) or {})
        for key in _NEEDS.get(kind, ()):
            if schedule.get(key) is None:
                problems.append(Problem(f"{path}.schedule_config.{key}", f"required when schedule_type is {kind!r}"))
        if kind == "fixed_discrete" and not problems and len(schedule["difficulty"]) != len(schedule["max_step"]) + 1:
            problems.append(Problem(f"{path}.schedule_config.max_step", "needs one entry fewer than difficulty"))
        if problems:
            raise ConfigError(problems)
        self.state: dict[str, Any] = {
            MIN_DIFFICULTY: config[MIN_DIFFICULTY], MAX_DIFFICULTY: config[MAX_DIFFICULTY],
            CURRENT_DIFFICULTY: config[MIN_DIFFICULTY], SCHEDULE_TYPE: kind, SCHEDULE_CONFIG: schedule}
        self.path = path
        self.custom_get_difficulty: Callable[[int], int] | None = None

    # --- DeepSpeed's interface ------------------------------------------------------------------------
    def get_current_difficulty(self) -> int:
        return self.state[CURRENT_DIFFICULTY]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state[CURRENT_DIFFICULTY] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The pacing function of a ``custom`` schedule: ``schedule_function(global_step) -> difficulty``."""
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at ``global_steps`` (not stored)."""
        kind, schedule = self.state[SCHEDULE_TYPE], self.state[SCHEDULE_CONFIG]
        if kind == "fixed_discrete":
            for difficulty, last_step in zip(schedule["difficulty"], schedule["max_step"]):
                if global_steps <= last_step:
                    return difficulty
            return schedule["difficulty"][-1]
        if kind in ("fixed_linear", "fixed_root"):
            root = 1 if kind == "fixed_linear" else schedule["root_degree"]
            return root_schedule_value(global_steps, schedule["total_curriculum_step"], self.state[MIN_DIFFICULTY],
                                       self.state[MAX_DIFFICULTY], schedule["difficulty_step"], root)
        if self.custom_get_difficulty is None:
            raise ConfigError(Problem(f"{self.path}.schedule_type", "is 'custom' but no schedule function was set",
                                      "call engine.set_custom_curriculum_learning_schedule(...) before training"))
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> int:
        """Advance to the schedule's value at ``global_steps`` unless ``max_difficulty`` is reached; returns
        the current difficulty."""
        if self.state[CURRENT_DIFFICULTY] < self.state[MAX_DIFFICULTY]:
            self.state[CURRENT_DIFFICULTY] = self.get_difficulty(global_steps)
        return self.state[CURRENT_DIFFICULTY]

    # --- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = copy.deepcopy(dict(state))
