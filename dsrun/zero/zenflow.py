"""ZenFlow as a feature of the engine (:mod:`dsrun.features`): ``zero_optimization.zenflow`` at ZeRO stages 1-2
with ``offload_optimizer.device: cpu`` (DeepSpeed's ZenFlow; the algorithm is
:mod:`dsrun.offload.zenflow_store`, the guide docs/zenflow.md).

Built when the section is present. Once the engine is built (``attach``) it reads the stage's flat layout
(each parameter's fragment of this rank's partition and its columns), resolves the intervals (``"auto"``
select strategy: every epoch; an epoch is ``steps_per_epoch`` optimizer steps, else the training data loader's
length; without either the columns are selected once) and puts a :class:`~dsrun.offload.zenflow_store.ZenFlowStore`
in place of the strategy's host store: a new placement of the update, so the strategy's one step path (overflow,
norm, clipping, hooks) is unchanged. Its pending window is saved with the optimizer state (the store's
``state_entries``). ``metrics()`` reports the CPU updates run and the largest staleness seen.

The core split: with ``overlap_step`` the CPU update runs on a worker thread pinned to the optimizer's cores,
``1 - pt_reserved_cores_perc`` of the process's, or ``offload_optimizer.cpuadam_cores_perc`` when that key is
set (:mod:`dsrun.offload.cores`).
"""
from __future__ import annotations

import math
from typing import Any

from dsrun.config import DSConfig
from dsrun.config.recent import ZenFlowConfig
from dsrun.features import Feature
from dsrun.offload.flat_store import HostFlatStore
from dsrun.offload.zenflow_store import Fragment, ZenFlowSettings, ZenFlowStore
from dsrun.utils.errors import ConfigError, Problem

KEY = "zero_optimization.zenflow"


def resolved_intervals(cfg: ZenFlowConfig, loader_steps: int | None) -> tuple[int, int]:
    """(select_interval, update_interval) in optimizer steps; 0 means "select once" and "auto"."""
    update = 0 if cfg.update_interval == "auto" else int(cfg.update_interval)
    if cfg.select_strategy == "step":
        return int(cfg.select_interval), update
    epochs = 1 if cfg.select_interval == "auto" else int(cfg.select_interval)
    epoch = cfg.steps_per_epoch or loader_steps or 0
    return epochs * epoch, update


def fragments(group: Any) -> list[Fragment]:
    """Each parameter of a stage-1/2 ``FlatGroup`` as this rank's partition holds it."""
    start, end = group.partition_range(group.rank)
    out = []
    for p, off, n in zip(group.params, group.offsets, group.numels):
        a, b = max(off, start), min(off + n, end)
        cols = math.prod(p.shape[1:]) if p.dim() >= 2 else 0
        out.append(Fragment(a - start, b - start, a - off, cols) if b > a else Fragment(0, 0, 0, cols))
    return out


class ZenFlowFeature(Feature):
    """Selective, overlapped offloaded updates (see the module docstring)."""

    def __init__(self, cfg: ZenFlowConfig, optimizer_share: float | None):
        self.cfg = cfg
        reserved = float(cfg.pt_reserved_cores_perc)
        self.training_share = reserved if optimizer_share is None else 1.0 - optimizer_share
        self.store: ZenFlowStore | None = None

    @classmethod
    def build(cls, config: DSConfig) -> "ZenFlowFeature | None":
        zero = config.zero_optimization
        if zero.zenflow is None:
            return None
        offload = zero.offload_optimizer
        share = offload.cpuadam_cores_perc if "cpuadam_cores_perc" in offload.model_fields_set else None
        return cls(zero.zenflow, share)

    def attach(self, engine: Any) -> None:
        strategy = engine.strategy
        store = getattr(strategy, "store", None)
        if strategy.stage not in (1, 2) or not isinstance(store, HostFlatStore):
            raise ConfigError(Problem(KEY, "ZenFlow needs ZeRO stage 1 or 2 with offload_optimizer.device cpu",
                                      "or remove zero_optimization.zenflow"))
        loader = getattr(engine, "training_dataloader", None)
        try:
            loader_steps = len(loader) if loader is not None else None
        except TypeError:  # an iterable without a length
            loader_steps = None
        select, update = resolved_intervals(self.cfg, loader_steps)
        settings = ZenFlowSettings(topk_ratio=float(self.cfg.topk_ratio), select_interval=select,
                                   update_interval=update, auto_ratio=float(self.cfg.auto_ratio),
                                   full_warm_up_rounds=int(self.cfg.full_warm_up_rounds),
                                   overlap_step=bool(self.cfg.overlap_step), training_core_share=self.training_share)
        try:
            self.store = ZenFlowStore(store, [fragments(g) for g in strategy.groups],
                                      [g.process_group for g in strategy.groups], settings)
        except ValueError as err:
            raise ConfigError(Problem(KEY, str(err), "use optimizer Adam or AdamW")) from None
        strategy.store = self.store

    def metrics(self) -> dict[str, float]:
        if self.store is None:
            return {}
        return {"zenflow_cpu_updates": float(self.store.cpu_updates),
                "zenflow_max_staleness": float(self.store.max_staleness)}
