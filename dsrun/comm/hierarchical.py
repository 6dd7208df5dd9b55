"""A two-level all-gather for a group that spans nodes (MiCS's ``mics_hierarchical_params_gather``).

The group's ranks are laid out node by node: ``L`` consecutive ranks per node, ``M`` nodes, rank ``(m, l)``
holding piece ``m * L + l`` of the result. First every node gathers its ``L`` pieces over the fast local
links (``local_group``): each rank then holds node ``m``'s block, consecutive in the result. Then the ranks
at the same place ``l`` on every node exchange their blocks (``across_group``, ``M`` ranks): one message per
peer node of ``L`` pieces instead of ``L`` separate ones, and the blocks land in node order, so the result
is the one-level all-gather's exactly (no reordering).
"""
from __future__ import annotations

import torch

from . import comm


def all_gather_hierarchical(output: torch.Tensor, input: torch.Tensor, local_group: comm.ProcessGroup,
                            across_group: comm.ProcessGroup) -> None:
    """Gather every rank's ``input`` into ``output`` (rank r's piece at r) in two synchronous steps:
    inside the node, then across nodes."""
    local = comm.get_world_size(local_group)
    block = torch.empty(local * input.numel(), dtype=input.dtype, device=input.device)
    if local > 1:
        comm.all_gather_into_tensor(block, input, group=local_group)
    else:
        block.copy_(input)
    if comm.get_world_size(across_group) > 1:
        comm.all_gather_into_tensor(output, block, group=across_group)
    else:
        output.copy_(block)
