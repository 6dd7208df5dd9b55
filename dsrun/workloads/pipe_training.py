"""What ``dsrun train``'s worker needs for a pipelined GPT (``model.pipeline_stages`` > 1): building it as a
PipelineModule, and evaluating it with ``eval_batch`` (a pipeline's forward is a schedule, not a call)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from dsrun.models.config import GPTConfig
from dsrun.models.registry import GPT_TARGET
from dsrun.utils.errors import ConfigError, Problem

from dsrun.workloads.pipe_gpt import gpt_pipeline
from dsrun.pipe.module import PipelineModule

if TYPE_CHECKING:
    from dsrun.data.corpus import TokenCorpus

    from .engine import PipelineEngine


def pipeline_stages(model_spec: Mapping[str, Any]) -> int:
    """``model.pipeline_stages`` (1 when absent)."""
    return int(model_spec.get("pipeline_stages", 1) or 1)


def build_pipeline_model(model_spec: Mapping[str, Any], ds_config: dict[str, Any], world_size: int) -> PipelineModule:
    """The GPT of ``model_spec`` as a PipelineModule of ``model.pipeline_stages`` stages."""
    from dsrun.config import load_ds_config, typed_config

    stages = pipeline_stages(model_spec)
    if model_spec.get("_target_") != GPT_TARGET:
        raise ConfigError(Problem("model.pipeline_stages", f"applies to dsrun's GPT ({GPT_TARGET}), not to "
                                  f"{model_spec.get('_target_')}", "wrap your own model in a dsrun.pipe.PipelineModule"))
    config = GPTConfig.from_kwargs({k: v for k, v in model_spec.items() if k != "_target_"})
    typed = typed_config(ds_config) or load_ds_config(  # the worker hands over the config it parsed
        ds_config, world_size=world_size // stages,
        world_size_source=f"{world_size} ranks / model.pipeline_stages={stages}")
    return gpt_pipeline(config, typed)


def evaluate(engine: PipelineEngine, corpus: TokenCorpus, batch_size: int, iters: int) -> float:
    """Mean eval loss over the same ``iters`` micro-batches of every data-parallel rank (every stage calls
    it; the first and last stages read the data)."""
    grid = engine.grid
    batches = list(corpus.eval_loader(batch_size, grid.get_data_parallel_rank(), grid.get_data_parallel_world_size(),
                                      max_batches=iters))
    return float(engine.eval_batch(iter(batches), num_micro_batches=len(batches)))
