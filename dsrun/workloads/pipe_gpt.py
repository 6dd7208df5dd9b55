"""The built-in GPT as a PipelineModule (``model.pipeline_stages`` > 1, the ``gpt_pipe`` recipe).

:func:`gpt_pipeline` turns :func:`dsrun.models.gpt_pipe.pipeline_layers` into layer specs (the embedding and
the tied head as :class:`~dsrun.pipe.spec.TiedLayerSpec` of one key) and builds the
PipelineModule with the ``pipeline`` config section's ``partition``, ``seed_layers`` and
``activation_checkpoint_interval`` (``model.activation_checkpointing: full`` means an interval of one
layer; ``every_N`` and ``selective`` are refused). Each rank builds only its stage's layers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dsrun.models.config import GPTConfig
from dsrun.models.gpt_pipe import dense_names, lm_loss, pipeline_layers
from dsrun.activation_checkpointing.modes import CheckpointMode
from dsrun.utils.errors import ConfigError, Problem

from dsrun.pipe.module import PipelineModule
from dsrun.pipe.settings import partition_method
from dsrun.pipe.spec import LayerSpec, TiedLayerSpec

if TYPE_CHECKING:
    from dsrun.config import DSConfig


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
