"""What a run trains, as one object the worker composes: :class:`Workload`.

``dsrun.worker.train`` reads top to bottom and names no feature: it asks its workload to build the model, to
give ``dsrun.initialize`` its inputs, to attach to the engine it got back, for the training loader, for one
optimizer step's loss, for an evaluation and for its extra metrics. The workloads are the dense GPT
(:mod:`dsrun.workloads.gpt`, with Ulysses sequence sharding), the pipelined GPT
(:mod:`dsrun.workloads.pipeline`) and a teacher's distillation (:mod:`dsrun.workloads.distill`);
:func:`dsrun.workloads.compose` picks one from the RunSpec. Every workload carries the run's data efficiency
(:mod:`dsrun.workloads.data_efficiency`).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from dsrun.utils.errors import UserError

from .data_efficiency import DataEfficiencyRun

if TYPE_CHECKING:
    from dsrun.data.corpus import TokenCorpus
    from dsrun.engine.engine import DeepSpeedEngine


def collective_device() -> torch.device:
    """Where a rank's small control tensors live: NCCL reduces only device tensors."""
    from dsrun.accelerator import get_accelerator

    return get_accelerator().device()


def mean_across_ranks(value: float) -> float:
    from dsrun import comm

    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
    comm.all_reduce(tensor)
    return tensor.item() / comm.get_world_size()


def zero_init_context(ds_config: dict[str, Any]) -> ContextManager[object]:
    """``dsrun.zero.Init`` for ZeRO stage 3 (so the whole model never exists in one process, and with
    ``offload_param`` its shards go straight to host memory or NVMe), else a no-op."""
    import dsrun
    from dsrun.config import ds_section

    if ds_section(ds_config, "zero_optimization").stage != 3:
        return contextlib.nullcontext()
    return dsrun.zero.Init(config_dict_or_path=ds_config)


class Workload:
    """One run's model and its training step. The worker calls, in order: :meth:`build_model`,
    :meth:`engine_inputs` (``dsrun.initialize``'s keywords), :meth:`attach` (the engine), :meth:`train_loader`,
    then per optimizer step :meth:`step`, now and then :meth:`evaluate` and :meth:`eval_counts`, and at the end
    :meth:`extra_metrics`. Subclasses build the model and say how a step runs."""

    def __init__(self, spec: DictConfig, ds_config: dict[str, Any], world_size: int) -> None:
        self.spec, self.ds_config, self.world_size = spec, ds_config, world_size
        self.cfg = spec.train
        self.model: nn.Module | None = None
        self.engine: DeepSpeedEngine | None = None
        self.data_efficiency: DataEfficiencyRun | None = None
        self.data_rank, self.data_world = 0, 1

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def engine_inputs(self, corpus: TokenCorpus, run_dir: Path) -> dict[str, Any]:
        """``dsrun.initialize``'s keywords: the model, and the config and training data after data efficiency
        prepared them (curriculum indexes)."""
        self.data_efficiency = DataEfficiencyRun.prepare(self.ds_config, corpus.train, corpus.vocab_size, run_dir)
        prepared = self.data_efficiency.ds_config
        if prepared is not self.ds_config and hasattr(self.ds_config, "with_sections"):
            # the curriculum's paths filled in: the rank's one typed config takes them too (dsrun.config)
            self.data_efficiency.ds_config = self.ds_config.with_sections(prepared)
        return dict(model=self.model, model_parameters=self.model.parameters(),
                    config=self.data_efficiency.ds_config, training_data=self.data_efficiency.training_data)

    def attach(self, engine: DeepSpeedEngine) -> None:
        """After initialize: random-LTD layers, seqlen truncation and token counts; this rank's data shard."""
        self.engine = engine
        self.data_efficiency.attach(engine)
        sp = engine.sequence_parallel_size  # Ulysses: a sequence group reads the same samples
        if sp > 1 and not getattr(getattr(self.model, "config", None), "sequence_parallel", False):
            raise UserError(f"ds.sequence_parallel_size={sp} needs a model that shards the sequence: set "
                            "model.sequence_parallel=true (or +recipe=gpt_ulysses)")
        self.data_rank, self.data_world = self.data_parallel(engine)

    def data_parallel(self, engine: DeepSpeedEngine) -> tuple[int, int]:
        """This rank's index among the ranks that read different samples, and their number."""
        raise NotImplementedError

    def train_loader(self, corpus: TokenCorpus) -> Iterator:
        """The curriculum sampler's loader when it is on, else the corpus's for this rank's data shard."""
        return self.data_efficiency.train_loader() or corpus.train_loader(
            batch_size=self.engine.train_micro_batch_size_per_gpu(), rank=self.data_rank,
            world_size=self.data_world, seed=self.cfg.seed)

    def step(self, loader: Iterator) -> float:
        """One optimizer step (all its micro-batches); the step's mean training loss."""
        raise NotImplementedError

    def evaluate(self, corpus: TokenCorpus, iters: int) -> float:
        raise NotImplementedError

    def num_params(self) -> int:
        """The whole model's parameter count (every stage, every ZeRO-3 shard)."""
        raise NotImplementedError

    def eval_counts(self) -> dict[str, Any]:
        """Tokens and layer-tokens trained so far (a collective: every rank calls it)."""
        return self.data_efficiency.counts()

    def extra_metrics(self) -> dict[str, Any]:
        return self.data_efficiency.summary()
