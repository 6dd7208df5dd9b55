"""The pipeline's run state as a feature of the engine (:mod:`dsrun.features`).

A :class:`~dsrun.pipe.module.PipelineModule`, not the config, makes a run a pipeline run, so the feature is not in
the registry: the :class:`~dsrun.pipe.engine.PipelineEngine` builds it for its module and puts it first among the
run's features. Through the protocol it

* prepares the module before the optimizer sees its parameters (:meth:`PipelineFeature.prepare_module`: the
  ``pipeline`` section checked against the module, the layers re-cut for the interleaved schedule's virtual
  stages);
* takes the run's topology, which is the module's grid (its :class:`~dsrun.comm.ProcessGroups` own every group,
  the tie groups too), refusing Ulysses sequence parallelism, whose groups it has none of;
* gives checkpoints the keys it owns (:meth:`PipelineFeature.checkpoint_entries`: ``mp_world_size``, the number
  of stage slices, and dsrun's ``"pipeline"`` entry, the saved stage layout that loading at another number of
  stages reads), and checks a loaded layout against the module (:meth:`PipelineFeature.load_checkpoint_entries`);
  the per-layer files themselves are written and read by :mod:`dsrun.pipe.checkpoint`;
* reports the last batch's timing (:meth:`PipelineFeature.metrics`: ``pipeline_s``, ``compute_s``,
  ``idle_fraction``) to the monitors as ``Train/Features/pipeline/<name>``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from torch import nn

from dsrun.checkpoint.pipeline_state import PIPELINE_KEY
from dsrun.comm.groups import ProcessGroups
from dsrun.features import Feature
from dsrun.utils.errors import ConfigError, Problem, UserError

from dsrun.pipe import settings

if TYPE_CHECKING:
    from dsrun.config import DSConfig

    from .topology import PipelineParallelGrid


class PipelineLayout(Protocol):
    """What the feature reads of the :class:`~dsrun.pipe.module.PipelineModule` (a Protocol: the module imports
    the engine, which imports this module)."""

    num_stages: int
    parts: list[int]
    virtual_stages: int
    _num_layers: int

    def mpu(self) -> PipelineParallelGrid: ...

    def tied_key_of(self, layer_idx: int) -> str | None: ...

    def layers_of_key(self, key: str) -> list[int]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


class CuttablePipeline(settings.BuiltPipeline, Protocol):
    """A module :meth:`PipelineFeature.prepare_module` checks and re-cuts."""

    def set_virtual_stages(self, virtual_stages: int) -> None: ...


def tied_layers(module: PipelineLayout) -> dict[str, list[int]]:
    """Each tied key of ``module`` -> the global indices of its layers."""
    keys = sorted({module.tied_key_of(i) for i in range(module._num_layers)} - {None})
    return {key: module.layers_of_key(key) for key in keys}


def expert_parallel_sizes(module: PipelineLayout) -> dict[str, int]:
    """This stage's MoE layers (by module name, the same at any number of stages) -> their expert-parallel size."""
    from dsrun.moe.layer import MoE

    return {name: m.ep_size for name, m in module.named_modules() if isinstance(m, MoE)}


@dataclass
class BatchTiming:
    """Where one batch's wall time went on this stage, while its schedule runs: the span from the start to the
    end of the last compute instruction, and the time spent in compute instructions."""

    start: float = field(default_factory=time.perf_counter)
    compute: float = 0.0
    last_compute_end: float | None = None

    def computed(self, began: float) -> None:
        """A compute instruction that began at ``began`` just ended."""
        self.last_compute_end = time.perf_counter()
        self.compute += self.last_compute_end - began

    def summary(self) -> dict[str, float]:
        """``pipeline_s`` (the span), ``compute_s`` and ``idle_fraction`` (time not computing, per compute time)."""
        span = (self.last_compute_end or self.start) - self.start
        return {"pipeline_s": span, "compute_s": self.compute,
                "idle_fraction": (span - self.compute) / self.compute if self.compute else 0.0}


class PipelineFeature(Feature):
    """The pipeline's share of the run: its topology, checkpoint entries and metrics (module docstring)."""

    name = "pipeline"

    def __init__(self, module: PipelineLayout, config: "DSConfig"):
        self.module = module
        self._config = config
        self.grid = module.mpu()
        self.timing: BatchTiming | None = None  # the running (or last) batch's, set by the engine's executor
        self.loaded_layout: dict[str, Any] | None = None  # the stage layout of the checkpoint loaded last

    @staticmethod
    def prepare_module(module: CuttablePipeline, config: "DSConfig") -> None:
        """Check the ``pipeline`` section against ``module`` and cut it into ``stages x virtual_stages`` chunks
        for the interleaved schedule, before the optimizer is built over its parameters (collective)."""
        settings.check_module(module, config)
        pipe = config.pipeline
        module.set_virtual_stages(pipe.virtual_stages if pipe.schedule == "interleaved" else 1)

    def take_topology(self, model: nn.Module, groups: ProcessGroups) -> None:  # type: ignore[override]
        """The run's groups are the module's grid; Ulysses' sequence groups are not among them."""
        if int(self._config.sequence_parallel_size) > 1:
            raise ConfigError(Problem("sequence_parallel_size", "Ulysses sequence parallelism does not compose with "
                                      "the pipeline engine yet", "set sequence_parallel_size to 1"))
        if groups is not self.grid.groups:
            raise ValueError("the pipeline engine's process groups must be its module's grid's")

    def layout(self) -> dict[str, Any]:
        """This stage's layout as a checkpoint records it (what loading at another number of stages reads)."""
        module = self.module
        return {"stages": module.num_stages, "parts": list(module.parts), "num_layers": module._num_layers,
                "virtual_stages": module.virtual_stages, "slice_rank": self.grid.get_slice_parallel_rank(),
                "tied": tied_layers(module), "dense_names": getattr(module, "dense_names", None),
                "moe_ep_sizes": expert_parallel_sizes(module)}

    def checkpoint_entries(self) -> dict[str, Any]:
        """``mp_world_size`` (DeepSpeed's key: the stage slices, every stage x model rank) and dsrun's
        ``"pipeline"`` entry (:meth:`layout`)."""
        return {"mp_world_size": self.grid.get_slice_parallel_world_size(), "dsrun": {PIPELINE_KEY: self.layout()}}

    def load_checkpoint_entries(self, states: dict[str, Any]) -> None:
        """Check the saved layout fits the module (the same layers) and keep it as :attr:`loaded_layout`.
        The pipeline load calls it before it reads the layer files; it may run again over the same states."""
        saved = (states.get("dsrun") or {}).get(PIPELINE_KEY)
        if saved is None:
            return
        if saved["num_layers"] != self.module._num_layers:
            raise UserError(Problem("load_checkpoint(load_dir=...)", f"the checkpoint has {saved['num_layers']} "
                                    f"layers, the PipelineModule {self.module._num_layers}", "load into the same model"))
        self.loaded_layout = dict(saved)

    def metrics(self) -> dict[str, float]:
        """The timing of the batch whose optimizer step this is (every compute instruction ran before it)."""
        return self.timing.summary() if self.timing is not None else {}
