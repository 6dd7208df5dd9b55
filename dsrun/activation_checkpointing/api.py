"""``dsrun.checkpointing``: DeepSpeed's ``deepspeed.checkpointing``, names and signatures kept.

::

    import dsrun
    dsrun.checkpointing.configure(mpu, deepspeed_config="ds_config.json")   # or dsrun.initialize does it
    hidden = dsrun.checkpointing.checkpoint(block, hidden, mask)            # reentrant, DeepSpeed's default
    hidden = dsrun.checkpointing.non_reentrant_checkpoint(block, hidden, mask=mask)
    with dsrun.checkpointing.get_cuda_rng_tracker().fork():                 # model-parallel dropout
        ...

The ``activation_checkpointing`` section of the DeepSpeed config (``partition_activations``,
``contiguous_memory_optimization``, ``number_checkpoints``, ``cpu_checkpointing``,
``synchronize_checkpoint_boundary``, ``profile``) configures every call. dsrun adds
``selective_checkpoint`` (keep the expensive outputs, recompute the rest) and the per-model modes
(``CheckpointMode``, ``BlockCheckpointing``). The implementation lives in
``dsrun/activation_checkpointing/``; see docs/activation_checkpointing.md.
"""
from __future__ import annotations

from dataclasses import replace

from dsrun.activation_checkpointing.checkpoint import (CheckpointFunction, checkpoint,
                                                               non_reentrant_checkpoint, reset)
from dsrun.activation_checkpointing.modes import BlockCheckpointing, CheckpointMode
from dsrun.activation_checkpointing.rng import (CudaRNGStatesTracker, get_cuda_rng_tracker,
                                                        model_parallel_cuda_manual_seed)
from dsrun.activation_checkpointing.selective import (SelectivePolicy, TransformerBlockPolicy,
                                                              selective_checkpoint)
from dsrun.activation_checkpointing.settings import STATE, configure, is_configured

__all__ = [
    "BlockCheckpointing", "CheckpointFunction", "CheckpointMode", "CudaRNGStatesTracker", "SelectivePolicy",
    "TransformerBlockPolicy", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
    "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint", "partition_activations_in_checkpoint",
    "reset", "selective_checkpoint", "set_num_layers",
]


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn partitioned activations on or off without reconfiguring the rest."""
    STATE.settings = replace(STATE.settings, partition_activations=bool(partition_activation))


def set_num_layers(nlayers: int) -> None:
    """Set ``number_checkpoints`` (the contiguous buffer's slots) without reconfiguring the rest."""
    STATE.settings = replace(STATE.settings, number_checkpoints=int(nlayers))
