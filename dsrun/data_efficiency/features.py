"""The engine's data-efficiency features, built once at initialize: what the engine calls at its seams.

- ``forward_kwargs(training, global_steps)``: the keyword arguments DeepSpeed adds to the model's forward
  while training: ``progressive_layer_drop=True, pld_theta=θ`` (PLD) and ``curriculum_seqlen=`` (legacy
  seqlen curriculum, updated to the schedule's value at ``global_steps + 1``); it also advances the random-LTD
  schedule to ``global_steps``, as DeepSpeed's forward does.
- ``before_step(global_steps)``: at an optimizer step (before the counter moves), PLD's θ moves to
  ``θ(global_steps)``.
- ``checkpoint_entries()`` / ``load_checkpoint_entries(states)``: the model-states keys these features own
  (``random_ltd``, ``data_sampler``, and dsrun's ``data_efficiency`` under ``dsrun``), so a resumed run
  continues every schedule, the sampler and the layer-token count exactly.

A technique is on when its own ``enabled`` and every enclosing ``enabled`` are true (DeepSpeed reads only the
innermost flag; dsrun warns once when an enclosing flag turns an enabled technique off).
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from dsrun import comm
from dsrun.config import DSConfig
from dsrun.features import Feature
from dsrun.utils.errors import ConfigError, Problem

from dsrun.data_efficiency.curriculum_scheduler import CurriculumScheduler
from dsrun.data_efficiency.data_routing.basic_layer import RandomLayerTokenDrop
from dsrun.data_efficiency.data_routing.scheduler import RandomLTDScheduler
from dsrun.data_efficiency.progressive_layer_drop import ProgressiveLayerDrop

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

RANDOM_LTD_PATH = "data_efficiency.data_routing.random_ltd"
SAMPLING_PATH = "data_efficiency.data_sampling.curriculum_learning"


def _gated(flags: list[tuple[str, bool]], notes: list[str]) -> bool:
    """True when every flag (outermost first) is on; a note when only the innermost is."""
    if not flags[-1][1]:
        return False
    off = [name for name, on in flags[:-1] if not on]
    if off:
        notes.append(f"{flags[-1][0]}.enabled is true but {off[0]}.enabled is false, so it stays off "
                     "(DeepSpeed would run it: it reads only the innermost flag)")
    return not off


def _accepts(module: nn.Module, *names: str) -> bool:
    """Whether ``module.forward`` takes these keyword arguments (or ``**kwargs``)."""
    params = inspect.signature(module.forward).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params) or all(n in {p.name for p in params} for n in names)


def _require_same_rng_on_every_rank(group: ProcessGroup | None) -> None:
    """Raise (on every rank) when the ranks' torch RNG states differ."""
    from dsrun.accelerator import get_accelerator

    state = torch.get_rng_state().to(torch.int64)
    digest = (state * torch.arange(1, len(state) + 1)).sum().reshape(1).to(get_accelerator().device())  # NCCL: device
    high, low = digest.clone(), digest.clone()
    comm.all_reduce(high, op=comm.ReduceOp.MAX, group=group)
    comm.all_reduce(low, op=comm.ReduceOp.MIN, group=group)
    if not torch.equal(high, low):
        raise ConfigError(Problem("progressive_layer_drop.enabled", "with ZeRO stage 3 every rank must skip the same "
                                  "layers, but the ranks' torch random number generators differ (a different seed "
                                  "per rank?)", "seed torch alike on every rank (dsrun train does), or use stage 0-2"))


class _Engine(Protocol):
    """What the feature reads of the engine it attaches to."""

    module: nn.Module
    dp_group: ProcessGroup | None
    training_dataloader: Any  # the engine's loader (DeepSpeed's attribute): whatever deepspeed_io built
    global_rank: int


class DataEfficiency(Feature):
    """Curriculum (legacy), progressive layer drop and random-LTD state for one engine: an engine feature
    (:mod:`dsrun.features`) that is always built, since DeepSpeed's data-efficiency engine methods read
    it whether or not a technique is on."""

    name = "data_efficiency"

    @classmethod
    def build(cls, config: DSConfig) -> "DataEfficiency":
        return cls(config)

    def __init__(self, config: DSConfig):
        de = config.data_efficiency
        train_batch_size = int(config.train_batch_size)
        self.notes: list[str] = []
        self.sampling_enabled = _gated([("data_efficiency", de.enabled), ("data_efficiency.data_sampling",
                                        de.data_sampling.enabled), (SAMPLING_PATH, de.data_sampling.curriculum_learning.enabled)],
                                       self.notes)
        self.random_ltd_enabled = _gated([("data_efficiency", de.enabled), ("data_efficiency.data_routing",
                                          de.data_routing.enabled), (RANDOM_LTD_PATH, de.data_routing.random_ltd.enabled)],
                                         self.notes)
        self.data_efficiency_config = de
        legacy = config.curriculum_learning
        self.curriculum_params_legacy = legacy
        self.curriculum_scheduler_legacy = CurriculumScheduler(legacy) if legacy.enabled else None
        pld = config.progressive_layer_drop
        self.progressive_layer_drop = ProgressiveLayerDrop(pld.theta, pld.gamma) if pld.enabled else None
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        if self.random_ltd_enabled:
            ltd = de.data_routing.random_ltd
            if ltd.layer_token_lr_schedule.enabled:
                raise ConfigError(Problem(f"{RANDOM_LTD_PATH}.layer_token_lr_schedule.enabled", "is not implemented "
                                          "(DeepSpeed raises NotImplementedError for it too)", "set it to false"))
            self.random_ltd_scheduler = RandomLTDScheduler(ltd, global_batch_size=train_batch_size)
        self._zero_stage = int(config.zero_optimization.stage)
        self._group: ProcessGroup | None = None
        self._check_pld_ranks = False
        self.random_ltd_layers: list[RandomLayerTokenDrop] = []
        self.training_dataloader: Any = None  # a curriculum loader from engine.deepspeed_io, when sampling is on
        # dynamic batching acts through the loader and scheduler a script asks for; enabled and never asked for,
        # the first step says so (variable_batch_size_and_lr sets this when it builds them)
        self.dynamic_batching_enabled = de.data_sampling.dynamic_batching.enabled
        self.dynamic_batching_loader_built = False
        self._rank = 0

    def attach(self, engine: _Engine) -> None:
        """Check the model's forward, take the engine's data-parallel group and (when sampling) its loader."""
        self.check_model(engine.module)
        # ZeRO-3 gathers each block's parameters as it runs: every rank must skip the same blocks, so their
        # torch RNG states (which the model's PLD draws come from) are compared once, at the first PLD forward
        self._group = engine.dp_group
        self._rank = engine.global_rank
        self._check_pld_ranks = (self.progressive_layer_drop is not None and self._zero_stage == 3
                                 and comm.get_world_size(self._group) > 1)
        if self.sampling_enabled:  # the sampler's state goes into checkpoints
            self.training_dataloader = engine.training_dataloader
        if engine.global_rank == 0:
            for note in self.notes:
                print(f"[dsrun] note: {note}", flush=True)
            if self.progressive_layer_drop is not None:
                print(f"[dsrun] Enabled progressive layer dropping (theta = {self.progressive_layer_drop.theta})",
                      flush=True)

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.curriculum_scheduler_legacy, self.progressive_layer_drop,
                                           self.random_ltd_scheduler)) or self.sampling_enabled

    def check_model(self, module: nn.Module) -> None:
        """Refuse, at initialize, a model whose forward cannot take the arguments the engine will pass."""
        problems = []
        if self.progressive_layer_drop is not None and not _accepts(module, "progressive_layer_drop", "pld_theta"):
            problems.append(Problem("progressive_layer_drop.enabled", f"{type(module).__name__}.forward takes no "
                                    "progressive_layer_drop/pld_theta arguments, so no layer would be dropped",
                                    "add them to the model's forward (dsrun's GPT has them) or disable PLD"))
        legacy = self.curriculum_params_legacy
        if self.curriculum_scheduler_legacy is not None and legacy.curriculum_type == "seqlen" \
                and not _accepts(module, "curriculum_seqlen"):
            problems.append(Problem("curriculum_learning.enabled", f"{type(module).__name__}.forward takes no "
                                    "curriculum_seqlen argument, so nothing would be truncated",
                                    "add it to the model's forward (dsrun's GPT has it) or disable it"))
        if problems:
            raise ConfigError(problems)

    # --- random-LTD layers --------------------------------------------------------------------------------
    def initialize_random_ltd(self, module: nn.Module) -> int:
        """Give the configured random-LTD layers (``random_ltd_layer_id``: positions among the converted
        layers, in module order) their schedule; returns how many were set up."""
        if self.random_ltd_scheduler is None:
            raise ConfigError(Problem(f"{RANDOM_LTD_PATH}.enabled", "random_ltd_initialize() needs random-LTD on",
                                      "enable data_efficiency, data_routing and random_ltd"))
        ltd = self.data_efficiency_config.data_routing.random_ltd
        wrapped = [m for m in module.modules() if isinstance(m, RandomLayerTokenDrop)]
        wanted = sorted(ltd.random_ltd_layer_id)
        if wanted and wanted[-1] >= len(wrapped):
            raise ConfigError(Problem(f"{RANDOM_LTD_PATH}.random_ltd_layer_id", f"names layer {wanted[-1]} but the "
                                      f"model has {len(wrapped)} converted layers",
                                      "convert the model's transformer layers with convert_to_random_ltd"))
        self.random_ltd_layers = [wrapped[i] for i in wanted]
        for count, layer in enumerate(self.random_ltd_layers):
            layer.init_config(ltd, self.random_ltd_scheduler, count)
        return len(self.random_ltd_layers)

    # --- the engine's seams -----------------------------------------------------------------------------
    def forward_kwargs(self, training: bool, global_steps: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if not training:
            return kwargs
        if self.progressive_layer_drop is not None:
            if self._check_pld_ranks:
                self._check_pld_ranks = False
                _require_same_rng_on_every_rank(self._group)
            kwargs.update(self.progressive_layer_drop.get_state())
        if self.curriculum_scheduler_legacy is not None:
            self.curriculum_scheduler_legacy.update_difficulty(global_steps + 1)
            if self.curriculum_params_legacy.curriculum_type == "seqlen":
                kwargs["curriculum_seqlen"] = self.curriculum_scheduler_legacy.get_current_difficulty()
        if self.random_ltd_scheduler is not None:
            if not self.random_ltd_layers:
                raise ConfigError(Problem(f"{RANDOM_LTD_PATH}.enabled", "is true but no layer of the model was "
                                          "converted, so no token would be dropped",
                                          "call dsrun.data_efficiency.convert_to_random_ltd(engine, LayerClass) "
                                          "after initialize"))
            self.random_ltd_scheduler.update_seq(global_steps)
        return kwargs

    def before_step(self, global_steps: int) -> None:
        if self.progressive_layer_drop is not None:
            self.progressive_layer_drop.update_state(global_steps)
        if self.dynamic_batching_enabled and not self.dynamic_batching_loader_built:
            self.dynamic_batching_enabled = False  # said once
            if self._rank == 0:
                print("[dsrun] warning: data_efficiency.data_sampling.dynamic_batching is enabled but this run "
                      "trains without its loader (batches are not packed to max_tokens, the LR is not scaled): "
                      "build them with get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, "
                      "engine, ...) (docs/data_efficiency.md#dynamic-batching), or set enabled: false",
                      flush=True)

    def curriculum_seqlen(self) -> int | None:
        """The legacy seqlen curriculum's current length (None when off)."""
        if self.curriculum_scheduler_legacy is None or self.curriculum_params_legacy.curriculum_type != "seqlen":
            return None
        return int(self.curriculum_scheduler_legacy.get_current_difficulty())

    # --- checkpoints -------------------------------------------------------------------------------------
    def checkpoint_entries(self) -> dict[str, Any]:
        """Model-states entries: DeepSpeed's ``random_ltd`` and ``data_sampler``, and dsrun's own states (under
        ``dsrun``, ``data_efficiency``)."""
        entries: dict[str, Any] = {}
        if self.random_ltd_scheduler is not None:
            entries["random_ltd"] = self.random_ltd_scheduler.state_dict()
        if self.training_dataloader is not None:
            entries["data_sampler"] = self.training_dataloader.data_sampler.state_dict()
        own = {}
        if self.curriculum_scheduler_legacy is not None:
            own["curriculum_learning_legacy"] = self.curriculum_scheduler_legacy.state_dict()
        if self.progressive_layer_drop is not None:
            own["progressive_layer_drop"] = self.progressive_layer_drop.state_dict()
        entries["dsrun"] = {"data_efficiency": own or None}
        return entries

    def load_checkpoint_entries(self, states: dict[str, Any]) -> None:
        if self.random_ltd_scheduler is not None and states.get("random_ltd"):
            self.random_ltd_scheduler.load_state_dict(states["random_ltd"])
        if self.training_dataloader is not None and isinstance(states.get("data_sampler"), dict) \
                and "curriculum_step" in states["data_sampler"]:
            self.training_dataloader.data_sampler.load_state_dict(states["data_sampler"])
        own = (states.get("dsrun") or {}).get("data_efficiency") or {}
        if self.curriculum_scheduler_legacy is not None and "curriculum_learning_legacy" in own:
            self.curriculum_scheduler_legacy.load_state_dict(own["curriculum_learning_legacy"])
        if self.progressive_layer_drop is not None and "progressive_layer_drop" in own:
            self.progressive_layer_drop.load_state_dict(own["progressive_layer_drop"])
