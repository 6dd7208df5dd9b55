"""Memory per pipeline stage: each stage holds its own layers' model states and the activations of the
micro-batches its schedule keeps in flight.

For stage ``s`` with ``P_s`` parameters (a tied embedding counted on every stage that uses it) and ``D``
data-parallel ranks, the model states are the ZeRO estimate of a ``P_s``-parameter model over ``D`` ranks
(:func:`dsrun.estimate.estimate_peak_bytes_per_rank`). The activations are ``A_s`` block-activations (the
peak, over the schedule, of the blocks whose micro-batch is between its forward and its weight gradient on
that stage: ``min(p - s, m)`` micro-batches x the stage's blocks for 1F1B, ``m`` for GPipe) times one
block's saved tensors for one micro-batch (:mod:`dsrun.estimate.activations`; with activation checkpointing
only the block inputs plus one recomputed block), the loss and logits on the last stage, and the backward
workspace. The peak adds the activations to the model-state peak: an upper bound when the model-state peak
falls in another phase than backward.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .activations import (element_size, gpt_backward_workspace_bytes, gpt_block_activation_bytes,
                          gpt_head_activation_bytes)
from .inputs import EstimateInputs
from .peak import estimate_peak_bytes_per_rank


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's estimate, bytes per rank."""

    stage: int
    layers: str  # e.g. "0-4"
    params: int
    blocks_in_flight: float  # block x micro-batch activations alive at the stage's peak
    model_states: int  # parameters, gradients, optimizer states (and master copies) per rank
    activations: int
    peak: int

    def to_dict(self) -> dict:
        return asdict(self)


def stage_memory(spec: EstimateInputs, stage: int, layers: str, params: int, blocks_in_flight: float,
                 holds_head: bool, data_parallel: int) -> StageMemory:
    """The estimate of one stage (see the module docstring); ``spec`` is the recipe's whole-model input."""
    alone = spec.with_(total_params=params, trainable_params=params, ranks_per_node=data_parallel, nodes=1,
                       largest_layer_params=min(spec.largest_layer_params, params),
                       small_params=min(spec.small_params, params), model_shape=None)
    states = estimate_peak_bytes_per_rank(alone)
    shape, b, s = spec.model_shape, spec.micro_batch_size, spec.seq_len
    activations = 0
    if shape is not None:
        elem = element_size(spec.precision)
        block = gpt_block_activation_bytes(shape, b, s, elem)
        if spec.checkpoint_mode.enabled:  # the blocks' inputs, plus one block recomputed in backward (full)
            activations = int(blocks_in_flight * elem * s * b * shape.n_embd) + block
        else:
            activations = int(blocks_in_flight * block)
        if holds_head:
            activations += gpt_head_activation_bytes(shape, b, s, elem)
        activations += gpt_backward_workspace_bytes(shape, b, s, elem)
    model_states = states.params + states.gradients + states.optimizer_states
    return StageMemory(stage=stage, layers=layers, params=params, blocks_in_flight=blocks_in_flight,
                       model_states=model_states, activations=activations, peak=states.peak_per_rank + activations)


def stages_table(rows: list[StageMemory], title: str) -> object:
    """A rich table of the stages."""
    from rich import box
    from rich.table import Table

    from .report import compact_bytes

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("stage", "layers", "params", "blocks x mb", "model states", "acts", "peak"):
        table.add_column(name, justify="left" if name in ("stage", "layers") else "right")
    for row in rows:
        table.add_row(str(row.stage), row.layers, f"{row.params:,}", f"{row.blocks_in_flight:g}",
                      compact_bytes(row.model_states), compact_bytes(row.activations), compact_bytes(row.peak))
    return table
