"""Data efficiency in ``dsrun train``: what a DeepSpeed user's script would do, done for the built-in GPT.

- :func:`prepare_ds_config`, before ``initialize``: a curriculum metric without index files whose name is a
  built-in metric (``vocabularyrarity``) is analysed here (a :class:`DataAnalyzer` map-reduce with one worker
  per rank, into ``RUN_DIR/data_analysis``) and its paths filled in; ``data_cluster_path`` defaults to
  ``RUN_DIR/data_clusters``.
- :func:`after_initialize`: random-LTD converts the GPT's blocks (``convert_to_random_ltd(engine, Block)``); a
  ``seqlen`` metric of the data sampler truncates each batch to its current difficulty
  (``engine.set_data_post_process_func``).
- :class:`LayerMeter`: the tokens and layer-tokens training really processed (after curriculum truncation,
  random-LTD and skipped layers), for the run's metrics.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dsrun.data_efficiency.data_routing.basic_layer import RandomLayerTokenDrop
from dsrun.data_efficiency.data_routing.helper import convert_to_random_ltd
from dsrun.data_efficiency.data_sampling.data_analyzer import ACCUMULATE, SINGLE_VALUE, DataAnalyzer
from dsrun.data_efficiency.data_sampling.data_loader import truncate_to_difficulty
from dsrun.data_efficiency.data_sampling.indexed_dataset import MMapIndexedDataset

RARITY, FREQUENCY = "vocabularyrarity", "token_frequency"
BUILT_IN_METRICS = (RARITY,)
ANALYSIS_DIR, CLUSTERS_DIR = "data_analysis", "data_clusters"
_BATCH = 4096


def _inputs(batch: Any) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def token_frequency_metric(vocab_size: int):
    """An ``accumulate_value_over_samples`` metric: how often each token id occurs in the inputs."""
    def metric(batch: Any) -> np.ndarray:
        return np.bincount(_inputs(batch).reshape(-1).numpy(), minlength=vocab_size).astype(np.int64)
    return metric


def vocabulary_rarity_metric(frequencies: np.ndarray):
    """A ``single_value_per_sample`` metric: ``round(100 · mean over the sample's tokens of -ln p(token))``,
    ``p`` the token's frequency in the training data (the data efficiency paper's vocabulary rarity, per token so
    that it does not grow with length; an integer, as the index stores integers)."""
    counts = frequencies.astype(np.float64)
    surprise = -np.log(np.maximum(counts, 1.0) / counts.sum())

    def metric(batch: Any) -> np.ndarray:
        tokens = _inputs(batch).numpy()
        return np.rint(100.0 * surprise[tokens].mean(axis=1)).astype(np.int64)
    return metric


def analyse_vocabulary_rarity(dataset: Any, vocab_size: int, save_path: Path, worker_id: int = 0,
                              num_workers: int = 1, comm_group: Any = None) -> Path:
    """Index ``dataset`` by vocabulary rarity into ``save_path`` (two map-reduce passes: token frequencies,
    then each sample's rarity); returns the metric's folder."""
    common = dict(num_workers=num_workers, worker_id=worker_id, batch_size=_BATCH, save_path=str(save_path))
    DataAnalyzer(dataset, metric_names=[FREQUENCY], metric_functions=[token_frequency_metric(vocab_size)],
                 metric_types=[ACCUMULATE], **common).run_map_reduce(comm_group)
    frequencies = MMapIndexedDataset(save_path / FREQUENCY / f"{FREQUENCY}_metric_value")[0]
    DataAnalyzer(dataset, metric_names=[RARITY], metric_functions=[vocabulary_rarity_metric(np.array(frequencies))],
                 metric_types=[SINGLE_VALUE], **common).run_map_reduce(comm_group)
    return save_path / RARITY


def prepare_ds_config(ds_config: dict[str, Any], dataset: Any, vocab_size: int, run_dir: Path) -> dict[str, Any]:
    """``ds_config`` with the analysis a curriculum needs done and its paths filled in (see the module
    docstring); unchanged when the data sampling curriculum is off."""
    de = ds_config.get("data_efficiency") or {}
    curriculum = (de.get("data_sampling") or {}).get("curriculum_learning") or {}
    if not (de.get("enabled") and (de.get("data_sampling") or {}).get("enabled") and curriculum.get("enabled")):
        return ds_config
    from dsrun import comm

    ds_config = copy.deepcopy(ds_config)
    curriculum = ds_config["data_efficiency"]["data_sampling"]["curriculum_learning"]
    curriculum.setdefault("data_cluster_path", None)
    if not curriculum["data_cluster_path"]:
        curriculum["data_cluster_path"] = str(run_dir / CLUSTERS_DIR)
    for name, metric in (curriculum.get("curriculum_metrics") or {}).items():
        if metric.get("clustering_type", "schedule_based") == "single_cluster" or metric.get("index_to_sample_path"):
            continue
        if name not in BUILT_IN_METRICS:
            continue  # the sampler names the missing index file
        rank, world = comm.get_rank(), comm.get_world_size()
        folder = analyse_vocabulary_rarity(dataset, vocab_size, run_dir / ANALYSIS_DIR, rank, world)
        merged = "_percentile_merged" if metric.get("difficulty_type") == "percentile" else ""
        metric["index_to_sample_path"] = str(folder / f"{name}_index_to_sample{merged}")
        metric["index_to_metric_path"] = str(folder / f"{name}_index_to_metric")
    return ds_config


def transformer_layers(model: nn.Module) -> nn.ModuleList | None:
    """The built-in GPT's blocks (``model.transformer["h"]``); None for another model."""
    transformer = getattr(model, "transformer", None)
    layers = transformer["h"] if isinstance(transformer, nn.ModuleDict) and "h" in transformer else None
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def after_initialize(engine: Any) -> None:
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


class LayerMeter:
    """Counts, while training, the tokens fed to the model and each layer's calls and tokens (a random-LTD
    layer counts the tokens it kept; a skipped layer counts nothing). Recomputation in backward (activation
    checkpointing) is not counted."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList):
        self.model = model
        self.tokens = self.layer_tokens = self.layer_calls = self.forwards = 0
        self.num_layers = len(layers)
        self._handles = [model.register_forward_pre_hook(self._on_model, with_kwargs=True)]
        for layer in layers:
            inner = layer.random_ltd_layer if isinstance(layer, RandomLayerTokenDrop) else layer
            self._handles.append(inner.register_forward_pre_hook(self._on_layer))

    @staticmethod
    def _counting(module: nn.Module) -> bool:
        return module.training and torch._C._current_graph_task_id() == -1

    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._counting(module):
            inputs = args[0] if args else kwargs.get("idx")
            inputs = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
            length = kwargs.get("curriculum_seqlen") or inputs.size(1)
            self.tokens += inputs.size(0) * min(int(length), inputs.size(1))
            self.forwards += 1

    def _on_layer(self, module: nn.Module, args: tuple) -> None:
        if self._counting(module):
            hidden = args[0]
            self.layer_tokens += hidden.size(0) * hidden.size(1)
            self.layer_calls += 1

    def totals(self) -> dict[str, float]:
        """This rank's counts so far, and the fraction of layer calls made (1 without layer drop)."""
        calls = self.forwards * self.num_layers
        return {"tokens": self.tokens, "layer_tokens": self.layer_tokens,
                "layers_executed_fraction": self.layer_calls / calls if calls else 1.0}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class DataEfficiencyRun:
    """The worker's data-efficiency steps, in order: :meth:`prepare` (before initialize), :meth:`attach`
    (after), :meth:`counts` at each evaluation (a collective), :meth:`summary` at the end."""

    def __init__(self, ds_config: dict[str, Any], training_data: Any):
        self.ds_config, self.training_data = ds_config, training_data
        self.meter: LayerMeter | None = None
        self.engine: Any = None

    @classmethod
    def prepare(cls, ds_config: dict[str, Any], dataset: Any, vocab_size: int, run_dir: Path) -> "DataEfficiencyRun":
        prepared = prepare_ds_config(ds_config, dataset, vocab_size, run_dir)
        return cls(prepared, dataset if prepared is not ds_config else None)

    def attach(self, engine: Any) -> None:
        self.engine = engine
        after_initialize(engine)
        layers = transformer_layers(engine.module)
        if layers is not None:
            self.meter = LayerMeter(engine.module, layers)

    def train_loader(self) -> Any:
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
