"""A Hugging Face model's own tensor-parallel plan as AutoTP rules (DeepSpeed's ``_get_hf_tp_plan`` and
``TPPlanConverter``).

Transformers models declare how they split: ``config.base_model_tp_plan`` (the base model's layers, e.g. Llama's
``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``) and the ``_tp_plan`` of the
model class or instance (the head: ``{"lm_head": "colwise_gather_output"}``). As in DeepSpeed, a run without
``partition_config`` / ``preset_model`` splits by that plan when the model has one, and reads the module tree
(:mod:`dsrun.tensor_parallel.split`) only when it has none. Each entry becomes a
:class:`~dsrun.tensor_parallel.autotp_config.TPLayerSpec`: ``colwise`` a column split, ``rowwise`` a row split,
``colwise_gather_output`` (``colwise_rep``, its older name) a column split whose output is gathered (a vocabulary
cut over the ranks: an odd vocabulary is cut unevenly), ``replicated_with_grad_allreduce`` a whole parameter whose
gradient is summed over the group. ``embedding_rowwise`` (transformers 5 puts it on Llama's ``embed_tokens``) keeps
the embedding whole, where DeepSpeed refuses the plan: a vocabulary-parallel embedding is not built, and its output
is the whole tensor either way. A plan naming another style is refused as a whole (applying half a column/row pair
would be wrong), as DeepSpeed refuses it.
"""
from __future__ import annotations

import re
from typing import Mapping

from torch import nn

from dsrun.utils.errors import ConfigError, Problem

from .autotp_config import AutoTPConfig, PartitionType, TPLayerSpec

_STYLES = {"colwise": (PartitionType.COLUMN, False), "colwise_rep": (PartitionType.COLUMN, True),
           "colwise_gather_output": (PartitionType.COLUMN, True), "rowwise": (PartitionType.ROW, False),
           "replicated_with_grad_allreduce": (PartitionType.SKIP, False),
           # a vocabulary-parallel embedding (its rows cut, the lookups all-reduced) gives every rank the whole
           # output, as the whole embedding does: kept whole (not built), not a reason to refuse the plan
           "embedding_rowwise": (PartitionType.SKIP, False)}


def _get_hf_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's plan: its config's ``base_model_tp_plan``, then its class's ``_tp_plan``, then the instance's
    (a later entry for the same pattern wins; a ``model.``-prefixed entry whose unprefixed pattern was given
    already is dropped). None when there is none."""
    config = getattr(model, "config", None)
    plans = (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
             vars(model).get("_tp_plan"))
    merged: dict[str, str] = {}
    seen: set[str] = set()
    for plan in plans:
        if not isinstance(plan, Mapping):
            continue
        for pattern, style in plan.items():
            bare = pattern.removeprefix("model.")
            if bare != pattern and bare in seen:
                continue
            merged[pattern] = style
            seen.add(bare)
    return merged or None


class TPPlanConverter:
    """DeepSpeed's ``deepspeed.module_inject.tp_plan_converter.TPPlanConverter``."""

    @staticmethod
    def _wildcard_to_regex(pattern: str) -> str:
        r"""A plan's module pattern as a regular expression matching anywhere a name ends so (``*``: any run of
        characters; everything else literal): ``layers.*.q_proj`` is ``.*layers\..*\.q_proj``."""
        return ".*" + re.escape(pattern).replace(r"\*", ".*")

    @staticmethod
    def _weight_regex(pattern: str) -> str:
        """The regular expression of the weight of the modules ``pattern`` names."""
        body = TPPlanConverter._wildcard_to_regex(pattern)
        return body + ("$" if body.endswith(r"\.weight") else r"\.weight$")

    @staticmethod
    def convert(hf_tp_plan: Mapping[str, str] | None) -> list[TPLayerSpec] | None:
        """The plan as layer specs (None for an empty plan); a style outside the supported ones refuses the plan
        (ConfigError, a ValueError, naming them)."""
        if not hf_tp_plan:
            return None
        unknown = sorted({style for style in hf_tp_plan.values() if str(style).lower() not in _STYLES})
        if unknown:
            raise ConfigError(Problem("the model's Hugging Face tp_plan", f"unsupported partition style(s) {unknown}"
                                      f" (AutoTP applies {sorted(_STYLES)}; applying only the rest could cut one "
                                      "half of a column/row pair)", "give tensor_parallel.partition_config for "
                                      "this model instead"))
        specs = []
        for pattern, style in hf_tp_plan.items():
            kind, gather = _STYLES[str(style).lower()]
            specs.append(TPLayerSpec(patterns=[TPPlanConverter._weight_regex(pattern)], partition_type=kind, gather_output=gather,
                                     grad_allreduce=str(style).lower() == "replicated_with_grad_allreduce"))
        return specs


def rules_from_hf_plan(model: nn.Module, tp_size: int) -> AutoTPConfig | None:
    """The AutoTP rules of ``model``'s Hugging Face plan, or None when it has none."""
    specs = TPPlanConverter.convert(_get_hf_tp_plan(model))
    return None if specs is None else AutoTPConfig(tp_size=tp_size, layer_specs=specs)

