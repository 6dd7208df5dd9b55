"""What a checkpoint keeps of its inputs until backward, and how it gets them back.

Only the inputs of a checkpointed function survive its forward. ``partition_activations`` keeps this rank's
slice of each floating-point input (identical on every rank of a model-parallel group, as the hidden
states of a tensor-parallel transformer are) and all-gathers the slices before the recompute, so each rank
holds ``1/mp`` of them. ``cpu_checkpointing`` moves what is kept to host memory (on a CPU rank it is
already there: a no-op, said once). ``contiguous_memory_optimization`` copies the partitions into one
preallocated buffer per input position, ``number_checkpoints`` slots long, instead of one allocation per
checkpoint, so the kept slices do not fragment device memory.

Integer tensors, ``None`` and other non-tensors are kept as they are (DeepSpeed partitions only
floating-point "activations"), as are tensors with fewer elements than the group has ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from dsrun import comm
from dsrun.activation_checkpointing.settings import SECTION, STATE, CheckpointingSettings, say_once
from dsrun.utils.errors import ConfigError, Problem

HOST = torch.device("cpu")


@dataclass(frozen=True)
class StashedInput:
    """How one input was kept: ``kept`` is what stays alive (the whole tensor, a slice, a host copy; None once
    the tensor is held elsewhere), ``is_tensor`` whether it is a tensor, ``shape``/``dtype``/``device`` set for
    an activation (a floating-point tensor, possibly partitioned or moved)."""

    kept: Any
    is_tensor: bool = False
    shape: torch.Size | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    partitioned: bool = False

    def without_tensor(self) -> "StashedInput":
        return replace(self, kept=None) if self.is_tensor else self


def _is_activation(item: object, mp_size: int) -> bool:
    """Is a checkpointed function's input (any value) an activation to keep as :class:`StashedInput` says?"""
    return isinstance(item, torch.Tensor) and item.is_floating_point() and item.numel() >= mp_size


def partition_numel(numel: int, parts: int) -> int:
    return -(-numel // parts)


def _my_slice(tensor: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    """This rank's ``ceil(numel / parts)`` elements of ``tensor`` flattened, zero-padded at the end."""
    size = partition_numel(tensor.numel(), parts)
    flat = tensor.detach().reshape(-1)
    start, end = min(rank * size, flat.numel()), min((rank + 1) * size, flat.numel())
    piece = flat[start:end]
    if piece.numel() == size:
        return piece.clone()
    padded = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
    padded[: piece.numel()].copy_(piece)
    return padded


def _into_contiguous_slot(position: int, piece: torch.Tensor, settings: CheckpointingSettings) -> torch.Tensor:
    """Copy ``piece`` into slot ``STATE.calls`` of input position ``position``'s buffer; returns the view."""
    slots = int(settings.number_checkpoints or 0)
    slot = STATE.calls
    if slot >= slots:
        raise ConfigError(Problem(f"{SECTION}.number_checkpoints",
                                  f"{slots} slots, but this forward makes checkpoint call {slot + 1}",
                                  "raise it to the checkpoint calls of one forward, or call "
                                  "dsrun.checkpointing.reset() between forwards that have no backward"))
    buffer = STATE.buffers.get(position)
    if buffer is None or buffer.numel() != slots * piece.numel() or buffer.dtype != piece.dtype \
            or buffer.device != piece.device:
        if buffer is not None and slot > 0:
            raise ConfigError(Problem(f"{SECTION}.contiguous_memory_optimization",
                                      f"input {position} of checkpoint call {slot + 1} has {piece.numel()} "
                                      f"{piece.dtype} elements per partition, the buffer's slots "
                                      f"{buffer.numel() // slots} {buffer.dtype}: it needs every checkpoint "
                                      "call to take inputs of one shape", "turn it off for this model"))
        buffer = torch.empty(slots * piece.numel(), dtype=piece.dtype, device=piece.device)
        STATE.buffers[position] = buffer
    view = buffer[slot * piece.numel():(slot + 1) * piece.numel()]
    # through .data: a write must not bump the version the views saved for earlier checkpoints share
    view.data.copy_(piece)
    return view


def stash_inputs(inputs: Sequence[Any]) -> list[StashedInput]:
    """Keep ``inputs`` as the configured settings say (see the module docstring)."""
    settings, mp = STATE.settings, STATE.model_parallel
    if settings.partition_activations and mp.world_size == 1:
        say_once("partition-mp1", "activation_checkpointing.partition_activations: the model-parallel group has "
                 "one rank, so whole activations are kept (pass an mpu with a larger model-parallel group to "
                 "dsrun.checkpointing.configure, or dsrun.initialize(mpu=...), to split them)")
    to_host = settings.cpu_checkpointing
    stashed = []
    for position, item in enumerate(inputs):
        if not _is_activation(item, mp.world_size):
            stashed.append(StashedInput(kept=item, is_tensor=isinstance(item, torch.Tensor)))
            continue
        if to_host and item.device.type == "cpu":
            say_once("cpu-on-cpu", "activation_checkpointing.cpu_checkpointing: the activations are already in "
                     "host memory on this CPU rank, nothing to move")
        partitioned = settings.partition_activations and mp.world_size > 1
        kept = _my_slice(item, mp.rank, mp.world_size) if partitioned else item.detach()
        if partitioned and settings.contiguous_memory_optimization and not STATE.recomputing:
            kept = _into_contiguous_slot(position, kept.to(HOST) if to_host else kept, settings)
        elif to_host:
            kept = kept.to(HOST)
        stashed.append(StashedInput(kept=kept, is_tensor=True, shape=item.shape, dtype=item.dtype, device=item.device,
                                    partitioned=partitioned))
    return stashed


def restore_inputs(stashed: Sequence[StashedInput], kept: Sequence[Any] | None = None) -> list[Any]:
    """The inputs again, whole and on their device. ``kept`` replaces each ``StashedInput.kept`` tensor in
    order (what autograd handed back from the saved tensors)."""
    mp = STATE.model_parallel
    values = iter(kept) if kept is not None else None
    restored = []
    for item in stashed:
        value = next(values) if values is not None and item.is_tensor else item.kept
        if item.shape is None:
            restored.append(value)
            continue
        value = value.to(item.device)
        if item.partitioned:
            full = torch.empty(value.numel() * mp.world_size, dtype=value.dtype, device=value.device)
            comm.all_gather_into_tensor(full, value.contiguous(), group=mp.group)
            value = full[: item.shape.numel()].view(item.shape)
        restored.append(value)
    return restored
