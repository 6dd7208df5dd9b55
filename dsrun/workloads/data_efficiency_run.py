"""Measuring a dataset and a model for data efficiency: the built-in curriculum metric (vocabulary rarity,
analysed by a :class:`DataAnalyzer` map-reduce) and :class:`LayerMeter`, the tokens and layer-tokens training
really processed. ``dsrun train`` uses them through :mod:`dsrun.workloads.data_efficiency`.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from dsrun.data_efficiency.data_routing.basic_layer import RandomLayerTokenDrop
from dsrun.data_efficiency.data_sampling.data_analyzer import ACCUMULATE, SINGLE_VALUE, DataAnalyzer
from dsrun.data_efficiency.data_sampling.indexed_dataset import MMapIndexedDataset

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: what a data loader yields: the inputs, or (inputs, targets, ...)
Batch = Union[torch.Tensor, Sequence[torch.Tensor]]

RARITY, FREQUENCY = "vocabularyrarity", "token_frequency"
_BATCH = 4096


def _inputs(batch: Batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def token_frequency_metric(vocab_size: int):
    """An ``accumulate_value_over_samples`` metric: how often each token id occurs in the inputs."""
    def metric(batch: Batch) -> np.ndarray:
        return np.bincount(_inputs(batch).reshape(-1).numpy(), minlength=vocab_size).astype(np.int64)
    return metric


def vocabulary_rarity_metric(frequencies: np.ndarray):
    """A ``single_value_per_sample`` metric: ``round(100 · mean over the sample's tokens of -ln p(token))``,
    ``p`` the token's frequency in the training data (the data efficiency paper's vocabulary rarity, per token so
    that it does not grow with length; an integer, as the index stores integers)."""
    counts = frequencies.astype(np.float64)
    surprise = -np.log(np.maximum(counts, 1.0) / counts.sum())

    def metric(batch: Batch) -> np.ndarray:
        tokens = _inputs(batch).numpy()
        return np.rint(100.0 * surprise[tokens].mean(axis=1)).astype(np.int64)
    return metric


def analyse_vocabulary_rarity(dataset: Dataset, vocab_size: int, save_path: Path, worker_id: int = 0,
                              num_workers: int = 1, comm_group: ProcessGroup | None = None) -> Path:
    """Index ``dataset`` by vocabulary rarity into ``save_path`` (two map-reduce passes: token frequencies,
    then each sample's rarity); returns the metric's folder."""
    common = dict(num_workers=num_workers, worker_id=worker_id, batch_size=_BATCH, save_path=str(save_path))
    DataAnalyzer(dataset, metric_names=[FREQUENCY], metric_functions=[token_frequency_metric(vocab_size)],
                 metric_types=[ACCUMULATE], **common).run_map_reduce(comm_group)
    frequencies = MMapIndexedDataset(save_path / FREQUENCY / f"{FREQUENCY}_metric_value")[0]
    DataAnalyzer(dataset, metric_names=[RARITY], metric_functions=[vocabulary_rarity_metric(np.array(frequencies))],
                 metric_types=[SINGLE_VALUE], **common).run_map_reduce(comm_group)
    return save_path / RARITY


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
