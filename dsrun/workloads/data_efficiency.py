"""Data efficiency in ``dsrun train``: what a DeepSpeed user's script would do, done for the built-in GPT.

- :func:`prepare_ds_config`, before ``initialize``: a curriculum metric without index files whose name is a
  built-in metric (``vocabularyrarity``) is analysed here (a :class:`DataAnalyzer` map-reduce with one worker
  per rank, into ``RUN_DIR/data_analysis``) and its paths filled in; ``data_cluster_path`` defaults to
  ``RUN_DIR/data_clusters``.
- :func:`after_initialize`: random-LTD converts the GPT's blocks (``convert_to_random_ltd(engine, Block)``); a
  ``seqlen`` metric of the data sampler truncates each batch to its current difficulty
  (``engine.set_data_post_process_func``).
- :class:`DataEfficiencyRun`: the steps above in the worker's order, with a
  :class:`~dsrun.workloads.data_efficiency_run.LayerMeter` counting the tokens and layer-tokens trained.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

from dsrun.data_efficiency.data_routing.helper import convert_to_random_ltd
from dsrun.data_efficiency.data_sampling.data_loader import truncate_to_difficulty
from dsrun.workloads.data_efficiency_run import RARITY, LayerMeter, analyse_vocabulary_rarity

if TYPE_CHECKING:
    from dsrun.data.dataset import TokenWindows
    from dsrun.engine.engine import DeepSpeedEngine

BUILT_IN_METRICS = (RARITY,)
ANALYSIS_DIR, CLUSTERS_DIR = "data_analysis", "data_clusters"


def prepare_ds_config(ds_config: dict[str, Any], dataset: TokenWindows, vocab_size: int,
                      run_dir: Path) -> dict[str, Any]:
    """``ds_config`` with the analysis a curriculum needs done and its paths filled in (see the module
    docstring); unchanged when the data sampling curriculum is off."""
    from dsrun.config import ds_section

    de = ds_section(ds_config, "data_efficiency")
    if not (de.enabled and de.data_sampling.enabled and de.data_sampling.curriculum_learning.enabled):
        return ds_config
    from dsrun import comm

    typed = de.data_sampling.curriculum_learning
    ds_config = copy.deepcopy(ds_config)
    curriculum = ds_config["data_efficiency"]["data_sampling"]["curriculum_learning"]  # the copy the paths go into
    curriculum["data_cluster_path"] = typed.data_cluster_path or str(run_dir / CLUSTERS_DIR)
    for name, metric in (typed.curriculum_metrics or {}).items():
        if metric.clustering_type == "single_cluster" or metric.index_to_sample_path:
            continue
        if name not in BUILT_IN_METRICS:
            continue  # the sampler names the missing index file
        rank, world = comm.get_rank(), comm.get_world_size()
        folder = analyse_vocabulary_rarity(dataset, vocab_size, run_dir / ANALYSIS_DIR, rank, world)
        merged = "_percentile_merged" if metric.difficulty_type == "percentile" else ""
        filled = curriculum["curriculum_metrics"][name]
        filled["index_to_sample_path"] = str(folder / f"{name}_index_to_sample{merged}")
        filled["index_to_metric_path"] = str(folder / f"{name}_index_to_metric")
    return ds_config


def transformer_layers(model: nn.Module) -> nn.ModuleList | None:
    """The built-in GPT's blocks (``model.transformer["h"]``); None for another model."""
    transformer = getattr(model, "transformer", None)
    layers = transformer["h"] if isinstance(transformer, nn.ModuleDict) and "h" in transformer else None
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def after_initialize(engine: DeepSpeedEngine) -> None:
    """Convert the GPT's blocks for random-LTD, and truncate batches for a ``seqlen`` metric."""
    layers = transformer_layers(engine.module)
    block_type = type(layers[0]) if layers is not None else None
    if engine.random_ltd_enabled():
        if block_type is None:
            from dsrun.utils.errors import ConfigError, Problem

            raise ConfigError(Problem("data_efficiency.data_routing.random_ltd.enabled", "dsrun train converts "
                                      "only the built-in GPT's blocks", "call convert_to_random_ltd in your script"))
        if getattr(getattr(engine.module, "config", None), "positions", "learned") == "rotary":
            from dsrun.utils.errors import ConfigError, Problem

            raise ConfigError(Problem("data_efficiency.data_routing.random_ltd.enabled", "the GPT's rotary "
                                      "positions come from each block's token order, which random-LTD changes",
                                      "use model.positions=learned with random-LTD"))
        convert_to_random_ltd(engine, block_type)
    metrics = engine.curriculum_learning_config().get("curriculum_metrics") or {}
    if engine.curriculum_learning_enabled() and "seqlen" in metrics:
        engine.set_data_post_process_func(truncate_to_difficulty("seqlen"))


class DataEfficiencyRun:
    """The worker's data-efficiency steps, in order: :meth:`prepare` (before initialize), :meth:`attach`
    (after), :meth:`counts` at each evaluation (a collective), :meth:`summary` at the end."""

    def __init__(self, ds_config: dict[str, Any], training_data: TokenWindows | None):
        self.ds_config, self.training_data = ds_config, training_data
        self.meter: LayerMeter | None = None
        self.engine: DeepSpeedEngine | None = None

    @classmethod
    def prepare(cls, ds_config: dict[str, Any], dataset: TokenWindows, vocab_size: int, run_dir: Path) -> "DataEfficiencyRun":
        prepared = prepare_ds_config(ds_config, dataset, vocab_size, run_dir)
        return cls(prepared, dataset if prepared is not ds_config else None)

    def attach(self, engine: DeepSpeedEngine) -> None:
        self.engine = engine
        after_initialize(engine)
        layers = transformer_layers(engine.module)
        if layers is not None:
            self.meter = LayerMeter(engine.module, layers)

    def train_loader(self) -> Iterable | None:
        """The curriculum loader when the data sampler is on, else None (the corpus's loader is used)."""
        return self.engine.training_dataloader if self.engine.curriculum_learning_enabled() else None

    def counts(self) -> dict[str, float]:
        """Tokens and layer-tokens trained so far by all ranks (every rank must call it)."""
        if self.meter is None:
            return {}
        from dsrun import comm

        totals = self.meter.totals()
        summed = torch.tensor([totals["tokens"], totals["layer_tokens"]], dtype=torch.float64,
                              device=self.engine.device)  # NCCL reduces only device tensors
        comm.all_reduce(summed)
        return {"tokens": int(summed[0].item()), "layer_tokens": int(summed[1].item()),
                "layers_executed_fraction": totals["layers_executed_fraction"]}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        scheduler = self.engine.data_efficiency.random_ltd_scheduler
        if scheduler is not None:
            out["random_ltd_consumed_layer_tokens"] = int(scheduler.state["consumed_layer_tokens"])
        if self.engine.pld_enabled():
            out["pld_theta"] = self.engine.get_pld_theta()
        seqlen = self.engine.data_efficiency.curriculum_seqlen()
        if seqlen is not None:
            out["curriculum_seqlen"] = seqlen
        return out
