"""``"auto"`` values, as Hugging Face integrations write them into DeepSpeed configs.

Order of resolution for a key whose value is the string ``"auto"``:

1. ``auto_values[dotted.key]`` when the caller knows the value (the runner fills these from the RunSpec:
   learning rate, batch sizes, precision, ...);
2. the batch keys (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
   ``gradient_accumulation_steps``) are treated as not given, so the batch arithmetic infers them from the
   others and the world size (an error names them when it cannot);
3. keys directly inside ``zero_optimization``, its two ``offload_*`` sections and the monitor sections
   (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``) are dropped, so their default applies: this is
   what DeepSpeed's own config models do;
4. anything else is a problem naming the key: DeepSpeed would fail on the string later.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from dsrun.utils.errors import Problem

from .batch import GAS, MBS, TBS
from .migrate import STAGE3_ALIASES

logger = logging.getLogger("dsrun.config")

AUTO = "auto"
BATCH_KEYS = (TBS, MBS, GAS)
# Sections whose DeepSpeed model drops "auto" values (DeepSpeedConfigModel).
DROPPING_SECTIONS = frozenset({
    "zero_optimization", "zero_optimization.offload_param", "zero_optimization.offload_optimizer",
    "tensorboard", "wandb", "csv_monitor", "comet",
})
# Keys where "auto" is a real value of the key, not a placeholder.
AUTO_IS_A_VALUE = frozenset({"pipeline.stages", *(f"zero_optimization.zenflow.{k}" for k in (
    "select_strategy", "select_interval", "update_interval"))})


def _normalise_key(key: str) -> str:
    parts = key.split(".")
    if len(parts) == 2 and parts[0] == "zero_optimization" and parts[1] in STAGE3_ALIASES:
        return f"zero_optimization.{STAGE3_ALIASES[parts[1]]}"
    return key


def resolve_auto(
    data: dict[str, Any], auto_values: Mapping[str, Any] | None, prefix: str = ""
) -> tuple[dict[str, Any], list[Problem], list[str]]:
    """Replace or drop ``"auto"`` values in a copy of ``data``.

    Returns (new dict, problems for unresolvable keys, batch keys left unset because they were "auto").
    """
    values = {_normalise_key(k): v for k, v in (auto_values or {}).items()}
    problems: list[Problem] = []
    dropped_batch: list[str] = []

    def walk(node: dict[str, Any], parts: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        section = ".".join(parts)
        for key, value in node.items():
            dotted = ".".join((*parts, key))
            if isinstance(value, dict):
                out[key] = walk(value, (*parts, key))
                continue
            if not (isinstance(value, str) and value == AUTO) or dotted in AUTO_IS_A_VALUE:
                out[key] = value
                continue
            if dotted in values:
                out[key] = values[dotted]
            elif not parts and key in BATCH_KEYS:
                dropped_batch.append(key)
            elif section in DROPPING_SECTIONS:
                logger.debug("%s: \"auto\" dropped, the default applies (as in DeepSpeed)", dotted)
            else:
                full = f"{prefix}{dotted}"
                problems.append(Problem(
                    full, "\"auto\" cannot be resolved here: nothing in the run gives this value",
                    "write the value, or let the runner supply it",
                ))
        return out

    return walk(data, ()), problems, dropped_batch
