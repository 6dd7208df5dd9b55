"""The dense GPT (or any ``model._target_`` called as ``model(inputs, targets) -> loss``): a step runs
``gradient_accumulation_steps`` micro-batches of forward, ``engine.backward`` and ``engine.step``. With Ulysses
(``sequence_parallel_size`` S > 1) a sequence group of S ranks reads the same samples and each keeps its slice
of every sequence (docs/sequence_parallel.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import hydra.utils
import torch
from torch import nn

from dsrun.sequence import shard_sequence

from .base import Workload, mean_across_ranks, zero_init_context

if TYPE_CHECKING:
    from dsrun.data.corpus import TokenCorpus
    from dsrun.engine.engine import DeepSpeedEngine


class DenseGPT(Workload):
    shard = False  # Ulysses: this rank keeps only its slice of each sequence

    def build_model(self) -> nn.Module:
        with zero_init_context(self.ds_config):  # ZeRO-3: partitioned as each part is built
            self.model = hydra.utils.instantiate(self.spec.model, _convert_="all")
        return self.model

    def attach(self, engine: DeepSpeedEngine) -> None:
        super().attach(engine)
        # the seqlen curriculum needs whole sequences (the GPT then slices them itself)
        self.shard = engine.sequence_parallel_size > 1 and engine.data_efficiency.curriculum_seqlen() is None

    def data_parallel(self, engine: DeepSpeedEngine) -> tuple[int, int]:
        """This rank's place among the ranks that read different samples: a sequence group (Ulysses) and a
        tensor-parallel group (AutoTP, the model axis) each read one rank's."""
        sp = engine.sequence_parallel_size
        return engine.groups.coord("data") // sp, engine.groups.size("data") // sp

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.engine(inputs, targets, sequence_sharded=True) if self.shard else self.engine(inputs, targets)

    def step(self, loader: Iterator) -> float:
        engine = self.engine
        accumulation = engine.gradient_accumulation_steps()
        step_loss = 0.0
        for _ in range(accumulation):
            inputs, targets = next(loader)
            if self.shard:
                inputs, targets = shard_sequence(inputs), shard_sequence(targets)
            inputs, targets = inputs.to(engine.device, non_blocking=True), targets.to(engine.device, non_blocking=True)
            loss = self.loss(inputs, targets)
            engine.backward(loss)
            engine.step()  # steps the optimizer only at the accumulation boundary
            step_loss += loss.item() / accumulation
        return step_loss

    @torch.no_grad()
    def evaluate(self, corpus: TokenCorpus, iters: int) -> float:
        """Mean eval loss (nats per token) over the same ``iters`` global batches every time."""
        engine = self.engine
        engine.eval()
        losses = [engine(inputs.to(engine.device), targets.to(engine.device)).item()
                  for inputs, targets in corpus.eval_loader(engine.train_micro_batch_size_per_gpu(), self.data_rank,
                                                            self.data_world, max_batches=iters)]
        engine.train()
        return mean_across_ranks(sum(losses) / max(1, len(losses)))

    def num_params(self) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())  # ZeRO-3: the full size
