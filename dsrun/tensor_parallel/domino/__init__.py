"""Domino (DeepSpeed's ``deepspeed.runtime.domino``): a Megatron-style tensor-parallel Transformer whose
communication hides behind computation.

The batch is cut in two halves that run interleaved: while half 0's row-parallel output is all-reduced over the
tensor-parallel group (asynchronously), half 1 computes, and the other way round; in backward each
column-parallel layer starts the all-reduce of its input gradient and computes its weight gradient while it
travels, and the wait happens only where that gradient is needed (at the layer norm below). On gloo the
collectives run on gloo's own threads, so the overlap is real on a CPU too. ``async_linear`` has the two
layers, ``transformer`` the layer and the two schedules (across layer boundaries, DeepSpeed's default, or
within each layer: ``config.domino_intra_layer_overlap``). docs/domino.md.
"""
from .async_linear import DominoAsyncColumnParallelLinear, RowParallelLinearNoComm
from .transformer import DominoTransformer, DominoTransformerLayer

__all__ = ["DominoAsyncColumnParallelLinear", "DominoTransformer", "DominoTransformerLayer",
           "RowParallelLinearNoComm"]
