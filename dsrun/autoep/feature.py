"""AutoEP as a feature of the engine (:mod:`dsrun.features`): the ``expert_parallel`` config section.

``wrap_model`` (before the optimizer sees the parameters) finds the model's MoE blocks and replaces each with an
:class:`~dsrun.autoep.layer.AutoEPMoELayer` holding this rank's ``num_experts / autoep_size`` experts; the
rank's place among its expert-parallel group follows the groups dsrun builds (:func:`dsrun.moe.groups.
_get_expert_parallel_ranks`, DeepSpeed's layout). The expert weights are tagged as DeepSpeed's MoE experts are
(``allreduce=False``, ``group_name="ep_size_E"``), so every ZeRO stage reduces (and at stage 3 partitions) them
over their expert-data-parallel group. ``take_topology`` binds each layer to its expert-parallel group. With
``autoep_size > 1`` each (layer, expert-parallel rank) checkpoints its grouped experts in a pair of files of its
own (``layer_{L}_autoep_{r}_of_{E}_mp_rank_00_{model,optim}_states.pt``, written by the first rank of the
expert-data-parallel group), so a run resumes at the same ``autoep_size``.
"""
from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from dsrun import comm
from dsrun.features import Feature, ParameterFiles
from dsrun.autoep.config import AUTOEP_KEYS, parse_autoep_config, validate_autoep_config, \
    validate_autoep_post_detection
from dsrun.autoep.detect import AutoEP
from dsrun.autoep.layer import AutoEPMoELayer
from dsrun.utils.errors import ConfigError, Problem

if TYPE_CHECKING:
    from dsrun.config import DSConfig


class _Engine(Protocol):
    """What the feature reads of the engine it attaches to."""

    module: nn.Module
    groups: Any  # dsrun.comm.ProcessGroups
    global_rank: int
    has_moe_layers: bool


def autoep_layers(model: nn.Module) -> list[tuple[str, AutoEPMoELayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)]


def _problem(key: str, message: str, hint: str) -> ConfigError:
    return ConfigError(Problem(f"expert_parallel.{key}" if key else "expert_parallel", message, hint))


class AutoEPFeature(Feature):
    """Built when ``expert_parallel.enabled`` is true."""

    name = "autoep"

    def __init__(self, config: "DSConfig", section: dict[str, Any]) -> None:
        self._config = config
        self.autoep = parse_autoep_config(section)
        self._engine: _Engine | None = None

    @classmethod
    def build(cls, config: "DSConfig") -> "AutoEPFeature | None":
        section = config.expert_parallel or {}
        unknown = sorted(set(section) - set(AUTOEP_KEYS))
        if unknown:
            close = difflib.get_close_matches(unknown[0], AUTOEP_KEYS, n=1)
            raise _problem(unknown[0], "is not an AutoEP key",
                           f"did you mean {close[0]!r}?" if close else f"the keys: {', '.join(AUTOEP_KEYS)}")
        try:
            feature = cls(config, section)
        except ValueError as exc:
            raise _problem("load_balance_coeff", str(exc), "set load_balance_coeff to null or omit it") from exc
        return feature if feature.autoep.enabled else None

    def _sizes(self) -> tuple[int, int, int]:
        tp = max(int(self._config.tensor_parallel.autotp_size or 0), 1)
        sp = int(getattr(self._config, "sequence_parallel_size", 1) or 1)
        return comm.get_world_size(), tp, sp

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Replace the model's MoE blocks with AutoEP layers holding this rank's experts."""
        world, tp, sp = self._sizes()
        zero = self._config.zero_optimization
        try:
            validate_autoep_config(self.autoep, world, 1, tp, sp, zero_stage=int(zero.stage),
                                   use_data_before_expert_parallel=bool(
                                       self._config.use_data_before_expert_parallelism),
                                   zero_offload_optimizer=zero.offload_optimizer.device != "none",
                                   zero_offload_param=zero.offload_param.device != "none")
        except ValueError as exc:
            raise _problem("", str(exc), "change the sizes it names") from exc
        if tp > 1:
            raise _problem("autoep_size", "AutoEP folded over AutoTP (tensor_parallel.autotp_size > 1) is not "
                           "implemented in dsrun", "use tensor_parallel.autotp_size=1 with expert_parallel")
        if sp > 1:
            raise _problem("autoep_size", "AutoEP with Ulysses sequence parallelism is not implemented in dsrun",
                           "set sequence_parallel_size to 1 with expert_parallel")
        auto_ep = AutoEP(model, self.autoep)
        specs = auto_ep.ep_parser()
        if not specs:
            return model
        try:
            validate_autoep_post_detection(self.autoep, specs)
        except ValueError as exc:
            raise _problem("autoep_size", str(exc), "pick a divisor of the layer's experts") from exc
        auto_ep.replace_moe_layers(specs, ep_size=self.autoep.autoep_size, ep_rank=self._ep_rank(world))
        return model

    def optimizer_params(self, model: nn.Module, params):
        """Experts in param groups of their own (as DeepSpeed's ``set_optimizer_flags`` after the replacement)."""
        from dsrun.moe.utils import split_params_into_different_moe_groups_for_optimizer

        if not autoep_layers(model):
            return params
        items = list(params)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
        return split_params_into_different_moe_groups_for_optimizer(groups)

    def _ep_rank(self, world: int) -> int:
        from dsrun.moe.groups import _get_expert_parallel_ranks

        expert_groups, _ = _get_expert_parallel_ranks(world, 1, self.autoep.autoep_size, 1, bool(
            self._config.use_data_before_expert_parallelism))
        rank = comm.get_rank() if comm.is_initialized() else 0
        return next(group.index(rank) for group in expert_groups if rank in group)

    def take_topology(self, model: nn.Module, groups) -> None:  # type: ignore[override]
        """Bind each AutoEP layer to its expert-parallel group of the run's groups (collective)."""
        from dsrun.comm.groups import current_groups, set_current_groups

        layers = autoep_layers(model)
        if not layers:
            return
        data_first = bool(self._config.use_data_before_expert_parallelism)
        groups.set_expert_layout(data_first)
        if current_groups() is not groups:
            set_current_groups(groups, data_first)
        for name, layer in layers:
            planned = layer.ep_rank
            layer.set_deepspeed_parallelism(data_first)
            if layer.ep_size > 1 and comm.get_rank(group=layer.ep_group) != planned:
                raise RuntimeError(f"AutoEP: {name} holds the experts of expert-parallel rank {planned}, but this rank "
                                   f"is rank {comm.get_rank(group=layer.ep_group)} of its expert-parallel group")

    def attach(self, engine: _Engine) -> None:  # type: ignore[override]
        """DeepSpeed's ZeRO placement record on each parameter: its family (``autoep_expert`` or ``replicated``)
        and the group it is reduced (at stage 3: partitioned) over, with its rank and size there."""
        self._engine = engine
        if not autoep_layers(engine.module):
            return
        engine.has_moe_layers = True
        for param in engine.module.parameters():
            family = getattr(param, "ds_zero_placement_family", "replicated")
            group = engine.groups.group_of_param(param)
            param.ds_zero_placement_family = family
            param.ds_zero_partition_group_name = param.group_name if family == "autoep_expert" else None
            param.ds_zero_partition_process_group = group
            param.ds_zero_partition_rank = comm.get_rank(group=group)
            param.ds_zero_partition_world_size = comm.get_world_size(group=group)

    def parameter_files(self) -> list[ParameterFiles]:
        engine = self._engine
        if engine is None or self.autoep.autoep_size == 1:
            return []  # every rank holds every expert: the model-states files have them
        out = []
        for index, (name, layer) in enumerate(autoep_layers(engine.module)):
            prefix = f"{name}.experts." if name else "experts."
            named = list(layer.experts.named_parameters())
            params = {prefix + n: p for n, p in named}
            stem = f"layer_{index}_autoep_{layer.ep_rank}_of_{layer.ep_size}_mp_rank_00"
            members = engine.groups.members_of_param(named[0][1])
            out.append(ParameterFiles(f"{stem}_model_states.pt", f"{stem}_optim_states.pt", params,
                                      {k: k for k in params}, writer=engine.global_rank == members[0]))
        return out
