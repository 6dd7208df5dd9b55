"""``zero_optimization.pipeline_loading_checkpoint`` (DeepSpeed's name; "pipeline" as in one after another, not
pipeline parallelism): the ranks of a node restore their ZeRO-3 optimizer state one at a time, local rank 0
first, each starting when the one before it has finished and dropped what it read. A node then holds one
rank's read of the checkpoint at a time instead of all of them at once: what lets a large model's checkpoint
load on a host whose RAM the ranks' reads together would exceed.

The hand-over is a one-element message from local rank ``l`` to ``l + 1`` (global ranks ``r`` and ``r + 1``, as
DeepSpeed's launcher numbers a node's ranks consecutively), counted by the comms logger as ``send``/``recv``.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from dsrun import comm


@contextlib.contextmanager
def one_local_rank_at_a_time(enabled: bool) -> Iterator[None]:
    """Run the body on this node's ranks in local-rank order when ``enabled`` (and more than one rank shares
    the node); otherwise as it is."""
    local, per_node = comm.get_local_rank(), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if not enabled or per_node < 2 or not comm.is_initialized():
        yield
        return
    rank, turn = comm.get_rank(), torch.zeros(1)
    if local > 0:
        comm.recv(turn, src=rank - 1)
    try:
        yield
    finally:
        if local < per_node - 1:
            comm.send(turn + 1, dst=rank + 1)
