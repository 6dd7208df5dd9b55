"""``dsrun estimate-memory`` for a pipelined GPT: which layers each stage holds (the module's own cut), how
many micro-batches its schedule keeps alive (walked from the schedule's instruction stream), and the bytes
(:mod:`dsrun.estimate.pipeline`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from dsrun.estimate.inputs import EstimateInputs
from dsrun.estimate.pipeline import StageMemory, stage_memory
from dsrun.models.config import GPTConfig
from dsrun.models.gpt_pipe import GPTBlock
from dsrun.pipe.schedule import BackwardPass, BackwardWeightPass, ForwardPass
from dsrun.pipe.settings import train_schedule

from .pipeline import local_params, stage_layers

if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.pipe.schedule import PipeSchedule


def blocks_in_flight(schedule: PipeSchedule, chunk_blocks: list[int]) -> float:
    """The peak, over ``schedule``'s stream, of the blocks whose micro-batch a stage holds activations for:
    a forward of chunk ``c`` adds ``chunk_blocks[c]``, its backward (or weight pass) releases them."""
    alive = peak = 0
    for step in schedule.steps():
        for cmd in step:
            blocks = chunk_blocks[getattr(cmd, "chunk_id", 0)] if hasattr(cmd, "buffer_id") else 0
            if isinstance(cmd, ForwardPass):
                alive += blocks
                peak = max(peak, alive)
            elif isinstance(cmd, (BackwardPass, BackwardWeightPass)):
                alive -= blocks
    return float(peak)


def pipeline_stage_memory(spec: EstimateInputs, model_spec: Mapping[str, Any], ds_config: DSConfig) -> list[StageMemory]:
    """Every stage's estimate for the recipe's GPT cut into ``model.pipeline_stages`` stages."""
    config = GPTConfig.from_kwargs({k: v for k, v in model_spec.items() if k != "_target_"})
    stages = config.pipeline_stages
    pipe = ds_config.pipeline
    virtual = pipe.virtual_stages if pipe.schedule == "interleaved" else 1
    kinds, sizes, parts = stage_layers(config, ds_config, stages * virtual)
    world = spec.ranks_per_node * spec.nodes
    data_parallel = max(1, world // stages)
    micro_batches = int(ds_config.gradient_accumulation_steps)
    rows = []
    for s in range(stages):
        chunks = [range(parts[c * stages + s], parts[c * stages + s + 1]) for c in range(virtual)]
        params = local_params(kinds, sizes, [i for chunk in chunks for i in chunk])
        chunk_blocks = [sum(1 for i in chunk if kinds[i].typename is GPTBlock) for chunk in chunks]
        alive = blocks_in_flight(train_schedule(ds_config, micro_batches, stages, s), chunk_blocks)
        layers = ", ".join(f"{c.start}-{c.stop - 1}" for c in chunks if len(c))
        rows.append(stage_memory(spec, s, layers, params, alive, holds_head=s == stages - 1,
                                 data_parallel=data_parallel))
    return rows
