"""ZeRO++ ``zero_quantized_nontrainable_weights``: the ZeRO-3 shards of frozen parameters kept quantized.

A frozen (``requires_grad=False``) parameter's shard of ``ds_partition_numel`` elements is replaced by its
INT8 message (:func:`dsrun.comm.quantized.encode`: one code byte per element, then one fp32 scale per
``WEIGHT_BLOCK`` elements), held in ``param.ds_quantized_shard`` (uint8, :func:`stored_bytes` bytes: about
1/4 of fp32, 1/2 of bf16); ``param.ds_tensor`` becomes an empty placeholder in the model's dtype. A gather
sends that message as it is and decodes every rank's into the full buffer (:mod:`.partition_params`), so
the value the model computes with is the dequantized one, ``code * scale``, within ``scale / 2`` of the
weight it was made from. That value is now the parameter's value: full-weight saves, ``GatheredParameters``
and checkpoints read it, and writing a new value (loading weights, ``modifier_rank``) quantizes it again.
"""
from __future__ import annotations

import torch

from dsrun.comm import quantized

ATTR = "ds_quantized_shard"


def store_quantized(param: torch.nn.Parameter, block: int = quantized.WEIGHT_BLOCK) -> None:
    """Keep ``param``'s shard as its INT8 message; ``ds_tensor`` becomes an empty placeholder. A parameter
    already kept quantized (a model handed to a second engine) stays as it is."""
    if message_of(param) is not None:
        return
    shard = param.ds_tensor
    setattr(param, ATTR, quantized.encode(shard, 8, block))
    param.ds_quantized_block = block
    param.ds_tensor = torch.empty(0, dtype=shard.dtype, device=shard.device)


def message_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The stored message of a parameter kept quantized (None: its shard is ``ds_tensor``)."""
    return getattr(param, ATTR, None)


def dequantized_shard(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's shard as the model computes with it (``ds_partition_numel`` elements, model dtype)."""
    values = quantized.decode(message_of(param), param.ds_partition_numel, 8, param.ds_quantized_block)
    return values.to(param.ds_tensor.dtype)


def write_quantized(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """Set the shard to ``values`` (``ds_partition_numel`` elements), quantized again."""
    with torch.no_grad():
        message_of(param).copy_(quantized.encode(values, 8, param.ds_quantized_block))


def set_message(param: torch.nn.Parameter, message: torch.Tensor) -> None:
    """Restore a stored message exactly (a checkpoint's copy of what this rank held)."""
    held = message_of(param)
    if message.shape != held.shape:
        raise RuntimeError(f"quantized shard of {tuple(param.ds_shape)} has {held.numel()} bytes on this rank, "
                           f"the checkpoint's has {message.numel()}")
    with torch.no_grad():
        held.copy_(message)


def stored_bytes(param: torch.nn.Parameter) -> int:
    """Bytes this rank holds of the parameter's shard: the message when kept quantized, else ``ds_tensor``'s."""
    message = message_of(param)
    if message is not None:
        return message.numel()
    return param.ds_tensor.numel() * param.ds_tensor.element_size()
