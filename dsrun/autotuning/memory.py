"""Pruning before launch: does a trial's configuration fit the memory limit, by dsrun's estimator?

The estimate (``dsrun.estimate``: model states + activations + buffers per rank, docs/estimate.md) is made
on the trial's composed RunSpec, with the model built on the meta device (once per distinct model). The need
of one rank is its device peak, plus its host-side (offloaded) bytes when the ranks run on the CPU.

The limit is ``tune.memory_limit`` / ``--memory-limit`` (bytes per rank) when set. Otherwise it is this
machine: a trial is pruned when the estimator's verdict against the host's RAM and the device's memory is
"too big" (:func:`dsrun.estimate.verdict.judge`).

The same estimate gives the trial's communication per optimizer step and rank
(:func:`dsrun.estimate.comm_volume.step_comm_volume`: all-gather, gradient and MiCS replica message bytes,
and the bytes leaving the rank), recorded with the trial; it follows ZeRO++ (qwZ, qgZ, frozen weights INT8),
MiCS and hpZ settings, which memory alone barely sees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dsrun.estimate import Breakdown
    from dsrun.estimate.inputs import EstimateInputs
    from dsrun.estimate.runspec import RecipeModel

MIB = 2**20


@dataclass(frozen=True)
class MemoryCheck:
    fits: bool
    need_bytes: int  # per rank
    limit_bytes: int | None  # per rank; None when judged against the machine
    reason: str
    breakdown: dict[str, Any]
    comm: dict[str, Any] | None = None  # the estimator's comm per optimizer step and rank (CommVolume.to_dict)


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


class MemoryGate:
    def __init__(self, limit_bytes: int | None):
        self.limit = limit_bytes
        self._models: dict[str, RecipeModel] = {}
        self._budget = None

    def _model(self, cfg: DictConfig) -> RecipeModel:
        from omegaconf import OmegaConf

        from dsrun.estimate.runspec import build_recipe_model

        key = OmegaConf.to_yaml(cfg.model)
        if key not in self._models:
            self._models[key] = build_recipe_model(cfg)
        return self._models[key]

    def estimate(self, cfg: DictConfig, **changes: object) -> Breakdown:
        """The estimator's :class:`~dsrun.estimate.Breakdown` for a composed RunSpec (``changes`` edit its
        inputs: any fields of :class:`~dsrun.estimate.inputs.EstimateInputs`, e.g. ``micro_batch_size=1``)."""
        from dsrun.estimate import estimate_peak_bytes_per_rank

        return estimate_peak_bytes_per_rank(self.inputs(cfg, **changes))

    def inputs(self, cfg: DictConfig, **changes: object) -> EstimateInputs:
        """The estimator's :class:`~dsrun.estimate.inputs.EstimateInputs` for a composed RunSpec, with ``changes``
        (any of its fields) made."""
        from dsrun.estimate.runspec import inputs_from_runspec

        inputs, _ = inputs_from_runspec(cfg, self._model(cfg))
        return inputs.with_(**changes) if changes else inputs

    def comm_per_step(self, cfg: DictConfig) -> dict[str, Any]:
        """The estimator's communication per optimizer step and rank, in bytes (``CommVolume.to_dict()``)."""
        from dsrun.estimate.comm_volume import step_comm_volume

        return step_comm_volume(self.inputs(cfg)).to_dict()

    def parameter_count(self, cfg: DictConfig) -> int:
        return int(self._model(cfg).counts.total)

    def check(self, cfg: DictConfig) -> MemoryCheck:
        import torch

        b = self.estimate(cfg)
        comm = self.comm_per_step(cfg)
        on_cpu = not torch.cuda.is_available()
        need = b.peak_per_rank + (b.offloaded if on_cpu else 0)  # model state, not the process's runtime/data
        parts = (f"model states {_mib(b.model_states)}, activations {_mib(b.activations)}, "
                 f"buffers {_mib(b.buffers)}")
        breakdown = {"need_per_rank": need, **{k: v for k, v in b.to_dict().items() if isinstance(v, (int, str))}}
        if self.limit is not None:
            fits = need <= self.limit
            relation = "<=" if fits else ">"
            return MemoryCheck(fits, need, self.limit, f"estimated {_mib(need)} per rank ({parts}) {relation} "
                               f"memory limit {_mib(self.limit)}", breakdown, comm)
        from dsrun.estimate.verdict import NO_FIT, detect_budget, judge

        if self._budget is None:
            self._budget = detect_budget()
        verdict = judge(b, self._budget)
        return MemoryCheck(verdict.level != NO_FIT, need, None,
                           f"estimated {_mib(need)} per rank ({parts}): {verdict.level}: {verdict.reason}", breakdown,
                           comm)
