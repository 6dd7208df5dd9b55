"""MoE as a feature of the engine (:mod:`dsrun.features`): its expert groups and what its experts put in
checkpoints.

When the engine has built the run's process groups, the feature makes them the run's groups and gives the
model's MoE layers their expert groups from them (``take_topology``: ``dsrun.moe.layer.attach_process_groups``,
laid out by ``use_data_before_expert_parallelism``); once attached it sets DeepSpeed's ``engine.moe_layers`` (the ``MOELayer``
modules), ``engine.gate_modules`` (their ``TopKGate``) and ``engine.has_moe_layers`` (with ``wall_clock_breakdown``
the layers time themselves for ``engine.print_forward_breakdown``), and tells the checkpoint code the rest. Each expert leaves the model-states files for a pair of its own
(DeepSpeed's ``layer_{L}_expert_{G}_mp_rank_00_model_states.pt``, L: the MoE layer's index in module order, G:
the expert's global id, and dsrun's ``..._optim_states.pt``), keyed by its parameter names with the local
expert index replaced by the global id; the first rank of each expert-data-parallel group writes them. Which
experts a rank holds depends on ``use_data_before_expert_parallelism``, saved as ``expert_data_first``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from dsrun.comm.groups import ProcessGroups, set_current_groups
from dsrun.features import Feature, ModelParameters, ParameterFiles
from dsrun.utils.errors import ConfigError, Problem

from . import groups as expert_groups
from .layer import MoE, attach_process_groups
from .utils import has_moe_layers, split_params_into_different_moe_groups_for_optimizer

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
    has_moe_layers: bool  # DeepSpeed's engine attribute: set by attach after take_topology
    strategy: object | None  # a ZeRO strategy: expert files are written only for a model trained through one
    groups: ProcessGroups
    global_rank: int


class MoEFeature(Feature):
    """Built for every run; it has files only once attached to an engine whose model has MoE layers and a ZeRO
    strategy (stages 0-3)."""

    name = "moe"

    def __init__(self, config: "DSConfig | None" = None) -> None:
        self._config = config
        self._engine: _Engine | None = None
        self._layers: list[MoE] | None = None  # the model's MoE layers, once take_topology ran

    @classmethod
    def build(cls, config: "DSConfig") -> "MoEFeature":
        return cls(config)  # the model, not the config, says whether there are experts

    def optimizer_params(self, model: nn.Module, params: ModelParameters) -> ModelParameters:
        """Experts in param groups of their own (DeepSpeed splits them the same way)."""
        if not has_moe_layers(model)[0]:
            return params
        items = list(params)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
        return split_params_into_different_moe_groups_for_optimizer(groups)

    def take_topology(self, model: nn.Module, groups: ProcessGroups) -> None:  # type: ignore[override]
        """Make ``groups`` the run's groups (expert groups that exist on the groups they replace are created on
        them too) and give every MoE layer of ``model`` its expert group (collective)."""
        data_first = bool(self._config is not None and self._config.use_data_before_expert_parallelism)
        set_current_groups(groups, data_first)
        self._layers = attach_process_groups(model, groups, data_first)
        if self._layers and self._config is not None:
            _check_moe_config(self._config)

    def attach(self, engine: _Engine) -> None:  # type: ignore[override]
        self._engine = engine
        if self._layers is not None:  # DeepSpeed's engine attributes: its MOELayer and TopKGate modules
            engine.moe_layers = [layer.deepspeed_moe for layer in self._layers]  # type: ignore[attr-defined]
            engine.gate_modules = [layer.deepspeed_moe.gate for layer in self._layers]  # type: ignore[attr-defined]
            engine.has_moe_layers = bool(self._layers)
            timed = bool(self._config is not None and self._config.wall_clock_breakdown)
            for module in (*engine.moe_layers, *engine.gate_modules):  # type: ignore[attr-defined]
                module.wall_clock_breakdown = timed  # engine.print_forward_breakdown reports them

    def close(self) -> None:
        if self._layers:
            expert_groups._reset()  # forget the run's groups and the expert groups' names

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


def _check_moe_config(config: "DSConfig") -> None:
    """MoE runs at ZeRO stages 0-3, with optimizer state (and ZeRO-3 parameters) on the device or offloaded to
    host memory; swapping them to NVMe is not built for experts' checkpoints yet: refuse it."""
    zc = config.zero_optimization
    for section in ("offload_optimizer", "offload_param"):
        if getattr(zc, section).device == "nvme" and int(zc.stage) > 0:
            raise ConfigError(Problem(f"zero_optimization.{section}.device",
                                      "MoE layers with ZeRO state offloaded to NVMe are not implemented in dsrun",
                                      f"set zero_optimization.{section}.device to \"cpu\" or \"none\" for MoE "
                                      "models"))
