"""The built-in GPT as a PipelineModule (``model.pipeline_stages`` > 1, the ``gpt_pipe`` recipe) and its workload.

:func:`gpt_pipeline` turns :func:`dsrun.models.gpt_pipe.pipeline_layers` into layer specs (the embedding and
the tied head as :class:`~dsrun.pipe.spec.TiedLayerSpec` of one key) and builds the
PipelineModule with the ``pipeline`` config section's ``partition``, ``seed_layers`` and
``activation_checkpoint_interval`` (``model.activation_checkpointing: full`` means an interval of one
layer; ``every_N`` and ``selective`` are refused). Each rank builds only its stage's layers.
:class:`PipelinedGPT` trains it: a step is the schedule's ``train_batch``, an evaluation its ``eval_batch``
(a pipeline's forward is a schedule, not a call). :func:`stage_layers` is every stage's cut without building a
stage (``dsrun estimate-memory`` and ``dsrun train --dry-run``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
from omegaconf import OmegaConf

from dsrun.models.config import GPTConfig
from dsrun.models.gpt_pipe import PipeLayer, dense_names, lm_loss, pipeline_layers
from dsrun.models.registry import GPT_TARGET
from dsrun.activation_checkpointing.modes import CheckpointMode
from dsrun.pipe.module import PipelineModule
from dsrun.pipe.partition import partition_layers
from dsrun.pipe.settings import partition_method
from dsrun.pipe.spec import LayerSpec, TiedLayerSpec
from dsrun.utils.errors import ConfigError, Problem

from .base import Workload, zero_init_context

if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.data.corpus import TokenCorpus
    from dsrun.pipe.engine import PipelineEngine


def layer_specs(config: GPTConfig) -> list[LayerSpec]:
    specs: list[LayerSpec] = []
    for layer in pipeline_layers(config):
        if layer.tie_key is None:
            specs.append(LayerSpec(layer.typename, config))
        else:
            specs.append(TiedLayerSpec(layer.tie_key, layer.typename, config, forward_fn=layer.forward_fn))
    return specs


def gpt_pipeline(config: GPTConfig, ds_config: DSConfig) -> PipelineModule:
    """A PipelineModule of ``config.pipeline_stages`` stages computing :class:`dsrun.models.gpt.GPT`."""
    pipe = ds_config.pipeline
    interval = int(pipe.activation_checkpoint_interval)
    mode = CheckpointMode.parse(config.activation_checkpointing)
    if mode.kind in ("every", "selective"):
        raise ConfigError(Problem("model.activation_checkpointing", f"{mode} is not available on a pipelined GPT "
                                  "(a pipeline checkpoints runs of consecutive layers)",
                                  "use full, or none with ds.pipeline.activation_checkpoint_interval=N"))
    if mode.enabled:
        if "activation_checkpoint_interval" in pipe.model_fields_set and interval != 1:
            raise ConfigError(Problem("model.activation_checkpointing", "full (every layer) disagrees with "
                                      f"ds.pipeline.activation_checkpoint_interval={interval}", "set one of them"))
        interval = 1
    if pipe.stages != "auto" and int(pipe.stages) != config.pipeline_stages:
        raise ConfigError(Problem("ds.pipeline.stages", f"got {pipe.stages}; model.pipeline_stages is "
                                  f"{config.pipeline_stages}", "set one of them (or pipeline.stages: auto)"))
    module = PipelineModule(layer_specs(config), num_stages=config.pipeline_stages, loss_fn=lm_loss,
                            seed_layers=bool(pipe.seed_layers), partition_method=partition_method(ds_config),
                            activation_checkpoint_interval=interval)
    module.config = config  # the analytic FLOPs (dsrun.models.accounting) read it
    module.dense_names = dense_names(config)  # universal checkpoints name parameters as the GPT does
    return module


def pipeline_stages(model_spec: Mapping[str, Any]) -> int:
    """``model.pipeline_stages`` (1 when absent)."""
    return int(model_spec.get("pipeline_stages", 1) or 1)


def gpt_config(model_spec: Mapping[str, Any]) -> GPTConfig:
    """The GPT of ``model_spec``; refused for another model (only dsrun's GPT is cut into stages here)."""
    if model_spec.get("_target_") != GPT_TARGET:
        raise ConfigError(Problem("model.pipeline_stages", f"applies to dsrun's GPT ({GPT_TARGET}), not to "
                                  f"{model_spec.get('_target_')}", "wrap your own model in a dsrun.pipe.PipelineModule"))
    return GPTConfig.from_kwargs({k: v for k, v in model_spec.items() if k != "_target_"})


def build_pipeline_model(model_spec: Mapping[str, Any], ds_config: dict[str, Any], world_size: int) -> PipelineModule:
    """The GPT of ``model_spec`` as a PipelineModule of ``model.pipeline_stages`` stages."""
    from dsrun.config import load_ds_config, typed_config

    stages = pipeline_stages(model_spec)
    config = gpt_config(model_spec)
    typed = typed_config(ds_config) or load_ds_config(  # the worker hands over the config it parsed
        ds_config, world_size=world_size // stages,
        world_size_source=f"{world_size} ranks / model.pipeline_stages={stages}")
    return gpt_pipeline(config, typed)


def stage_layers(config: GPTConfig, ds_config: DSConfig, parts: int) -> tuple[list[PipeLayer], list[int], list[int]]:
    """The GPT's pipeline layers, each one's parameter count (built on the meta device) and the module's cut of
    them into ``parts`` (``parts[i]:parts[i+1]`` is part ``i``; "profile" estimated as "parameters")."""
    method = partition_method(ds_config)
    if method == "profile":  # needs a measurement: estimate with the parameter-balanced cut
        method = "parameters"
    kinds = pipeline_layers(config)
    with torch.device("meta"):
        sizes = [sum(p.numel() for p in layer.typename(config).parameters()) for layer in kinds]
    return kinds, sizes, partition_layers(layer_specs(config), parts, method)


def local_params(kinds: list[PipeLayer], sizes: list[int], local: list[int]) -> int:
    """Parameters a stage holding the layers ``local`` owns (a tied layer once per key)."""
    tied = {kinds[i].tie_key for i in local if kinds[i].tie_key}
    params = sum(sizes[i] for i in local if not kinds[i].tie_key)
    return params + sum(sizes[next(i for i in local if kinds[i].tie_key == key)] for key in tied)


class PipelinedGPT(Workload):
    """The GPT in ``model.pipeline_stages`` stages: the data-parallel rank is the grid's, one step is the
    schedule running every micro-batch through the stages and stepping the optimizer."""

    def build_model(self) -> PipelineModule:
        with zero_init_context(self.ds_config):
            self.model = build_pipeline_model(OmegaConf.to_container(self.spec.model, resolve=True), self.ds_config,
                                              self.world_size)
        return self.model

    def data_parallel(self, engine: PipelineEngine) -> tuple[int, int]:
        return engine.grid.get_data_parallel_rank(), engine.dp_world_size

    def step(self, loader: Iterator) -> float:
        return float(self.engine.train_batch(loader))

    def evaluate(self, corpus: TokenCorpus, iters: int) -> float:
        """Mean eval loss over the same ``iters`` micro-batches of every data-parallel rank (every stage calls
        it; the first and last stages read the data)."""
        grid = self.engine.grid
        batches = list(corpus.eval_loader(self.engine.train_micro_batch_size_per_gpu(),
                                          grid.get_data_parallel_rank(), grid.get_data_parallel_world_size(),
                                          max_batches=iters))
        return float(self.engine.eval_batch(iter(batches), num_micro_batches=len(batches)))

    def num_params(self) -> int:
        return self.model.config.num_parameters()  # the whole model, not one stage
