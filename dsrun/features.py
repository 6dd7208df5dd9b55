"""The one way a feature attaches to the engine: a :class:`Feature` built from its config section, walked in the
order of :data:`REGISTRY`.

``dsrun.initialize`` builds every registered feature (``build`` returns None when its section is off), lets each
wrap the model before the optimizer sees its parameters, and hands the list to the engine, which attaches them
once it is built and then calls their hooks in registry order:

=====================================  ===========================================================================
``build(config)``                      a classmethod: the feature for this typed config, or None when it is off
``wrap_model(model)``                  before the optimizer is built; parameters it adds are optimized too
``optimizer_params(model, params)``    the parameters (or groups) the optimizer is built over, unless the client
                                       passed an optimizer object (MoE: experts in groups of their own)
``group_sizes()``                      axes the run's topology needs beside data (Ulysses: ``{"sequence": S}``)
``take_topology(model, groups)``       when the engine has built the run's process groups, before it broadcasts
                                       the model and builds its strategy: wire the model to them (collective)
``sharding_policy()``                  when the engine builds a stage-3 strategy: the sharding policy it supplies
                                       (``dsrun.zero.sharding.ShardingPolicy``: ZeRO++/MiCS/hpZ), or None
``gradient_accumulation()``            when the engine builds its ZeRO strategy: the gradient accumulation it
                                       supplies (``dsrun.zero.grad_accum.GradientAccumulation``: the dtype
                                       gradients accumulate in over micro-steps), or None: the stage's own
``attach(engine)``                     once, after the engine is built: take its groups and strategy, register
                                       hooks on ``engine.strategy.hooks`` (``dsrun/zero/step_hooks.py``)
``forward_kwargs(training, step)``     keyword arguments added to the model's forward
``before_step(step)``                  at an accumulation boundary, before the optimizer step
``after_step(overflow)``               after the optimizer (and scheduler) step of a boundary
``checkpoint_entries()``               model-states keys it owns (a ``"dsrun"`` dict merges into dsrun's own)
``load_checkpoint_entries(states)``    the loaded model states (``states["dsrun"]`` is dsrun's own dict)
``parameter_files()``                  parameters it checkpoints in files of their own (:class:`ParameterFiles`)
``owns_checkpoint_name(name)``         whether a module-state key (any saved run's naming) is in those files
``checkpoint_layout_matches(states)``  whether this run holds its files' state where the loaded run did
``metrics()``                          name -> value, written to the monitors as ``Train/Features/<name>/<key>``
``close()``                            at ``engine.destroy()``
=====================================  ===========================================================================

This module imports nothing from dsrun at run time (the config type only for annotations), so a feature in
any room can subclass it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, Protocol, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from dsrun.config import DSConfig

F = TypeVar("F", bound="Feature")
# what initialize takes as model_parameters and builds the optimizer over: parameters, or param-group dicts
ModelParameters = Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]


class Topology(Protocol):
    """The run's process groups as ``take_topology`` receives them (a :class:`dsrun.comm.ProcessGroups`; the comm
    room shares this module's layer, so it is named here, not imported); a feature narrows it to that class."""

    rank: int

    @property
    def sequence_parallel_size(self) -> int: ...


@dataclass
class ParameterFiles:
    """Parameters a feature checkpoints in a pair of files of their own instead of the model-states files (MoE:
    each expert, in DeepSpeed's ``layer_{L}_expert_{G}_mp_rank_00_model_states.pt``), keyed by the names saved
    there; ``dsrun/checkpoint/experts.py`` writes and reads them, resharding their optimizer state."""

    model_file: str  # {saved name: weight}
    optim_file: str  # dsrun's companion: {"fp32": {saved name: master}, "optimizer_state": {saved name: {...}}}
    params: dict[str, nn.Parameter]  # saved name -> this rank's parameter
    local_names: dict[str, str]  # saved name -> the parameter's name in this rank's module
    writer: bool  # whether this rank writes the files (every rank holding them calls the collective save)


class Feature:
    """A feature of the engine; every hook is a no-op until overridden."""

    name: ClassVar[str] = ""

    @classmethod
    def build(cls: type[F], config: "DSConfig") -> F | None:
        """The feature for this run's config, or None when it is off."""
        return None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def optimizer_params(self, model: nn.Module, params: ModelParameters) -> ModelParameters:
        """The parameters (or param groups) a client callable or the config's optimizer is built over."""
        return params

    def group_sizes(self) -> dict[str, int]:
        """Sizes of the axes this feature needs in the engine's :class:`dsrun.comm.ProcessGroups` (keyword
        arguments of its constructor; the groups of a client mpu or a pipeline grid have none)."""
        return {}

    def take_topology(self, model: nn.Module, groups: Topology) -> None:
        """Called by the engine with the run's process groups before it broadcasts ``model`` and builds its ZeRO
        strategy; every rank calls it with the same model (a feature may create groups here)."""

    def sharding_policy(self) -> Any:
        """The stage-3 sharding policy this feature supplies (a ``dsrun.zero.sharding.ShardingPolicy``: which group
        each parameter is partitioned over, its gathers, the gradient reduce-scatter), or None: plain ZeRO-3's.
        Called by the engine when it builds its strategy, after ``take_topology``, on every rank (a policy may
        create groups)."""
        return None

    def gradient_accumulation(self) -> Any:
        """The gradient accumulation this feature supplies to the ZeRO strategy the engine builds (a
        ``dsrun.zero.grad_accum.GradientAccumulation``: ``data_types.grad_accum_dtype``), or None: the stage
        accumulates as it does natively."""
        return None

    def attach(self, engine: Any) -> None:
        """Called once with the built engine (its ``groups``, ``strategy``, ``module``)."""

    def forward_kwargs(self, training: bool, global_steps: int) -> dict[str, Any]:
        return {}

    def before_step(self, global_steps: int) -> None:
        """At an accumulation boundary, before the optimizer step (``global_steps`` not yet advanced)."""

    def after_step(self, overflow: bool) -> None:
        """After a boundary's optimizer step (skipped when ``overflow``) and the scheduler's."""

    def checkpoint_entries(self) -> dict[str, Any]:
        return {}

    def load_checkpoint_entries(self, states: dict[str, Any]) -> None:
        """``states``: the whole loaded model-states dict."""

    def parameter_files(self) -> list[ParameterFiles]:
        """This rank's parameters the feature checkpoints in files of their own, in the same order on every rank
        of a group that shares them (the save gathers their state collectively)."""
        return []

    def owns_checkpoint_name(self, name: str) -> bool:
        """Whether module-state key ``name`` (this run's or a saved run's naming) lives in this feature's
        :meth:`parameter_files`, not in the model-states files."""
        return False

    def checkpoint_layout_matches(self, states: dict[str, Any]) -> bool:
        """Whether this run holds the state of its :meth:`parameter_files` on the ranks the run that saved the
        loaded model ``states`` did (then each rank's own optimizer file holds it, as usual)."""
        return True

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Release what the feature holds (``engine.destroy()``)."""


# the feature classes the engine builds, in the order their hooks run; rooms add theirs with register_feature
REGISTRY: list[type[Feature]] = []


def register_feature(cls: type[F]) -> type[F]:
    """Add ``cls`` to :data:`REGISTRY` (once); usable as a class decorator."""
    if cls not in REGISTRY:
        REGISTRY.append(cls)
    return cls


def unregister_feature(cls: type[Feature]) -> None:
    if cls in REGISTRY:
        REGISTRY.remove(cls)


class Features:
    """The engine's built features, in registry order; the engine calls the hooks through it."""

    def __init__(self, features: Iterable[Feature] = ()):
        self._features = list(features)

    @classmethod
    def build(cls, config: "DSConfig") -> "Features":
        return cls(f for f in (feature_cls.build(config) for feature_cls in REGISTRY) if f is not None)

    def __iter__(self) -> Iterator[Feature]:
        return iter(self._features)

    def __len__(self) -> int:
        return len(self._features)

    def get(self, cls: type[F]) -> F | None:
        """The built feature of class ``cls`` (None when off)."""
        return next((f for f in self._features if isinstance(f, cls)), None)

    def wrap_model(self, model: nn.Module, model_parameters: Any = None, optimizer: Any = None
                   ) -> tuple[nn.Module, Any]:
        """Let each feature wrap ``model``; parameters they add join ``model_parameters`` (a client optimizer
        gets them as a new parameter group). Returns ``(model, model_parameters)``."""
        before = {id(p) for p in model.parameters()}
        for feature in self._features:
            model = feature.wrap_model(model)
        added = [p for p in model.parameters() if id(p) not in before]
        return model, _with_parameters(model_parameters, optimizer, added)

    def optimizer_params(self, model: nn.Module, params: ModelParameters) -> ModelParameters:
        for feature in self._features:
            params = feature.optimizer_params(model, params)
        return params

    def group_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for feature in self._features:
            sizes.update(feature.group_sizes())
        return sizes

    def take_topology(self, model: nn.Module, groups: Topology) -> None:
        for feature in self._features:
            feature.take_topology(model, groups)

    def sharding_policy(self) -> Any:
        """The one sharding policy a feature supplies (None: plain ZeRO-3's); two features supplying one is an
        error."""
        supplied = [(feature, policy) for feature in self._features
                    if (policy := feature.sharding_policy()) is not None]
        if len(supplied) > 1:
            names = ", ".join(feature.name or type(feature).__name__ for feature, _ in supplied)
            raise ValueError(f"features {names} each supply a stage-3 sharding policy; the strategy takes one")
        return supplied[0][1] if supplied else None

    def gradient_accumulation(self) -> Any:
        """The one gradient accumulation a feature supplies (None: the stage's own)."""
        supplied = [a for feature in self._features if (a := feature.gradient_accumulation()) is not None]
        if len(supplied) > 1:
            raise ValueError("more than one feature supplies the ZeRO strategy's gradient accumulation")
        return supplied[0] if supplied else None

    def attach(self, engine: Any) -> None:
        for feature in self._features:
            feature.attach(engine)

    def forward_kwargs(self, training: bool, global_steps: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for feature in self._features:
            kwargs.update(feature.forward_kwargs(training, global_steps))
        return kwargs

    def before_step(self, global_steps: int) -> None:
        for feature in self._features:
            feature.before_step(global_steps)

    def after_step(self, overflow: bool) -> None:
        for feature in self._features:
            feature.after_step(overflow)

    def checkpoint_entries(self) -> dict[str, Any]:
        """Every feature's model-states entries; their ``"dsrun"`` dicts merged into one."""
        entries: dict[str, Any] = {}
        own: dict[str, Any] = {}
        for feature in self._features:
            mine = dict(feature.checkpoint_entries())
            own.update(mine.pop("dsrun", None) or {})
            entries.update(mine)
        if own:
            entries["dsrun"] = own
        return entries

    def load_checkpoint_entries(self, states: dict[str, Any]) -> None:
        for feature in self._features:
            feature.load_checkpoint_entries(states)

    def parameter_files(self) -> list[ParameterFiles]:
        return [files for feature in self._features for files in feature.parameter_files()]

    def owns_checkpoint_name(self, name: str) -> bool:
        return any(feature.owns_checkpoint_name(name) for feature in self._features)

    def checkpoint_layout_matches(self, states: dict[str, Any]) -> bool:
        return all(feature.checkpoint_layout_matches(states) for feature in self._features)

    def metrics(self) -> dict[str, float]:
        """``{"<feature name>/<key>": value}`` over every feature."""
        return {f"{feature.name or type(feature).__name__}/{key}": float(value)
                for feature in self._features for key, value in feature.metrics().items()}

    def close(self) -> None:
        for feature in self._features:
            feature.close()


def _with_parameters(model_parameters: Any, optimizer: Any, added: list[torch.nn.Parameter]) -> Any:
    if not added:
        return model_parameters
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.add_param_group({"params": added})
        return model_parameters
    if model_parameters is None or not isinstance(model_parameters, (list, tuple)):
        return model_parameters  # None or a generator: read after this, so it already yields the new parameters
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return items + [{"params": added}]
    return items + added
