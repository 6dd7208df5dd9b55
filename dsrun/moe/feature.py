"""MoE as a feature of the engine (:mod:`dsrun.features`): what its experts put in checkpoints.

The engine gives MoE layers their expert groups when it is built (``dsrun.moe.layer.attach_process_groups``);
this feature tells the checkpoint code the rest. Each expert leaves the model-states files for a pair of its own
(DeepSpeed's ``layer_{L}_expert_{G}_mp_rank_00_model_states.pt``, L: the MoE layer's index in module order, G:
the expert's global id, and dsrun's ``..._optim_states.pt``), keyed by its parameter names with the local
expert index replaced by the global id; the first rank of each expert-data-parallel group writes them. Which
experts a rank holds depends on ``use_data_before_expert_parallelism``, saved as ``expert_data_first``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from dsrun.comm.groups import ProcessGroups
from dsrun.features import Feature, ParameterFiles

from .layer import MoE

if TYPE_CHECKING:
    from dsrun.config import DSConfig

MARK = ".deepspeed_experts."  # in every expert parameter's name, DeepSpeed's and dsrun's


def model_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_optim_states.pt"


class _Engine(Protocol):
    """What the feature reads of the engine it attaches to."""

    module: nn.Module
    has_moe_layers: bool
    strategy: object | None  # a ZeRO strategy: expert files are written only for a model trained through one
    groups: ProcessGroups
    global_rank: int


class MoEFeature(Feature):
    """Built for every run; it has files only once attached to an engine whose model has MoE layers and a ZeRO
    strategy (stages 0-3)."""

    name = "moe"

    def __init__(self) -> None:
        self._engine: _Engine | None = None

    @classmethod
    def build(cls, config: "DSConfig") -> "MoEFeature":
        return cls()  # the model, not the config, says whether there are experts

    def attach(self, engine: _Engine) -> None:  # type: ignore[override]
        self._engine = engine

    @property
    def _active(self) -> bool:
        engine = self._engine
        return engine is not None and engine.has_moe_layers and engine.strategy is not None

    def _data_first(self) -> bool:
        return bool(self._engine is not None and getattr(self._engine.groups, "expert_data_first", False))

    def checkpoint_entries(self) -> dict[str, Any]:
        # which experts each rank's own files hold depends on how expert groups were laid out
        return {"dsrun": {"expert_data_first": self._data_first()}} if self._active else {}

    def checkpoint_layout_matches(self, states: dict[str, Any]) -> bool:
        if not self._active:
            return True
        return bool((states.get("dsrun") or {}).get("expert_data_first", False)) == self._data_first()

    def owns_checkpoint_name(self, name: str) -> bool:
        return self._active and MARK in name

    def parameter_files(self) -> list[ParameterFiles]:
        """One entry per expert of this rank, layers in module order, experts in local order."""
        engine = self._engine
        if engine is None or not self._active:
            return []
        out = []
        prefixes = {id(m): name for name, m in engine.module.named_modules()}
        layers = [m for m in engine.module.modules() if isinstance(m, MoE)]
        for li, layer in enumerate(layers):
            base = prefixes[id(layer)]
            experts_prefix = (base + "." if base else "") + "deepspeed_moe.experts.deepspeed_experts."
            for j, (g, expert) in enumerate(zip(layer.global_expert_ids(),
                                                layer.deepspeed_moe.experts.deepspeed_experts)):
                named = list(expert.named_parameters())
                params = {f"{experts_prefix}{g}.{name}": p for name, p in named}
                local = {f"{experts_prefix}{g}.{name}": f"{experts_prefix}{j}.{name}" for name, _ in named}
                members = engine.groups.members_of_param(named[0][1]) if named else [engine.global_rank]
                out.append(ParameterFiles(model_file(li, g), optim_file(li, g), params, local,
                                          writer=engine.global_rank == members[0]))
        return out
