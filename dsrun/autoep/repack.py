"""From a Hugging Face MoE block's expert weights to AutoEP's grouped ``w1``/``w2``/``w3`` for one rank's experts.

Two source layouts: ``fused_3d`` (Transformers >= 5: ``gate_up_proj`` and ``down_proj`` are ``[E, ...]``
tensors, gate and up either fused or apart) and ``module_list`` (one module per expert with ``nn.Linear``
projections). Sources partitioned by ZeRO-3 are gathered (every rank reads, none modifies) while read.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from dsrun.autoep.spec import MoELayerSpec
from dsrun.zero import GatheredParameters
from dsrun.zero.partition_params import is_zero_param

FusedLayout = Literal["gate_up_first", "hidden_first"]


@dataclass(frozen=True)
class FusedExpertLayout:
    """How a fused gate+up tensor is laid out, and the sizes it implies."""
    layout: FusedLayout
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool


def classify_fused_gate_up_layout(w1_shape: tuple[int, ...], w2_shape: tuple[int, ...]) -> FusedExpertLayout | None:
    """``gate_up_first``: ``w1`` is ``[E, 2*ffn, hidden]`` and ``w2`` ``[E, hidden, ffn]`` (Hugging Face's);
    ``hidden_first``: ``[E, hidden, 2*ffn]`` and ``[E, ffn, hidden]``; None when the shapes are neither."""
    if len(w1_shape) != 3 or len(w2_shape) != 3:
        return None
    _, a, b = w1_shape
    if a % 2 == 0 and tuple(w2_shape[1:]) == (b, a // 2):
        return FusedExpertLayout("gate_up_first", hidden_size=b, ffn_hidden_size=a // 2, needs_transpose=False)
    if b % 2 == 0 and tuple(w2_shape[1:]) == (b // 2, a):
        return FusedExpertLayout("hidden_first", hidden_size=a, ffn_hidden_size=b // 2, needs_transpose=True)
    return None


@contextmanager
def _gather_source_zero_params(params):
    """Gather the ZeRO-partitioned ones among ``params`` (None entries allowed) for the block."""
    partitioned = [p for p in params if p is not None and is_zero_param(p)]
    if not partitioned:
        yield
        return
    with GatheredParameters(partitioned, modifier_rank=None, enabled=True):
        yield


def _local_range(spec: MoELayerSpec, ep_rank: int, ep_size: int) -> tuple[int, int]:
    per_rank = spec.num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def repack_expert_weights(experts_source: nn.Module, spec: MoELayerSpec, ep_rank: int,
                          ep_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of rank ``ep_rank``'s experts as ``w1`` (gate) ``[E_local, ffn, hidden]``, ``w2`` (down)
    ``[E_local, hidden, ffn]`` and ``w3`` (up) ``[E_local, ffn, hidden]``."""
    start, end = _local_range(spec, ep_rank, ep_size)
    if spec.expert_storage == "fused_3d":
        return _repack_fused_3d(experts_source, spec, start, end)
    if spec.expert_storage == "module_list":
        return _repack_module_list(experts_source, spec, start, end)
    raise ValueError(f"Unknown expert_storage type: {spec.expert_storage}")


def repack_expert_requires_grad_flags(experts_source: nn.Module, spec: MoELayerSpec, ep_rank: int,
                                      ep_size: int) -> tuple[bool, bool, bool]:
    """Whether ``w1``, ``w2``, ``w3`` train: as their sources do (a frozen source stays frozen)."""
    start, end = _local_range(spec, ep_rank, ep_size)
    if spec.expert_storage == "fused_3d":
        w1 = bool(getattr(getattr(experts_source, spec.expert_w1_name), "requires_grad", False))
        w2 = bool(getattr(getattr(experts_source, spec.expert_w2_name), "requires_grad", False))
        w3 = w1 if spec.expert_w3_name is None else bool(
            getattr(getattr(experts_source, spec.expert_w3_name), "requires_grad", False))
        return w1, w2, w3
    if spec.expert_storage != "module_list":
        raise ValueError(f"Unknown expert_storage type: {spec.expert_storage}")
    flags = []
    for name in (spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name):
        if name is None:
            flags.append(flags[0])
            continue
        values = {bool(_get_expert_weight(experts_source[i], name).requires_grad) for i in range(start, end)}
        if len(values) != 1:
            raise ValueError(f"AutoEP cannot preserve mixed requires_grad flags for module_list experts "
                             f"{start}:{end} weight '{name}' because they are packed into one grouped expert tensor.")
        flags.append(values.pop())
    return tuple(flags)


def _data(t):
    return t.data if torch.is_tensor(t) else t


def _repack_fused_3d(experts_source: nn.Module, spec: MoELayerSpec, start: int, end: int):
    w1_full = getattr(experts_source, spec.expert_w1_name)
    w2_full = getattr(experts_source, spec.expert_w2_name)
    w3_full = getattr(experts_source, spec.expert_w3_name) if spec.expert_w3_name is not None else None
    with _gather_source_zero_params([w1_full, w2_full, w3_full]):
        # copies taken inside the gather: a gathered source is released when the block ends
        w1 = _data(w1_full)[start:end].clone()
        w2 = _data(w2_full)[start:end].clone()
        if w3_full is not None:
            return w1.contiguous(), w2.contiguous(), _data(w3_full)[start:end].clone().contiguous()
        layout = classify_fused_gate_up_layout(tuple(w1.shape), tuple(w2.shape))
        if layout is None:
            raise ValueError(f"Unsupported fused expert weight layout for AutoEP repacking: "
                             f"{spec.expert_w1_name}={tuple(w1.shape)}, {spec.expert_w2_name}={tuple(w2.shape)}")
        ffn = layout.ffn_hidden_size
        if layout.layout == "gate_up_first":
            return w1[:, :ffn, :].contiguous(), w2.contiguous(), w1[:, ffn:, :].contiguous()
        return (w1[:, :, :ffn].transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous(),
                w1[:, :, ffn:].transpose(1, 2).contiguous())


def _get_expert_weight(expert: nn.Module, name: str) -> torch.Tensor:
    """``expert.<name>`` as a tensor: a Parameter itself, or the ``weight`` of a Linear (or any child with one)."""
    found = getattr(expert, name, None)
    if isinstance(found, (nn.Parameter, torch.Tensor)):
        return found
    if found is not None and hasattr(found, "weight"):
        return found.weight
    raise ValueError(f"Could not find weight '{name}' in expert module {type(expert).__name__}. Available "
                     f"attributes: {[n for n, _ in expert.named_parameters(recurse=False)]}")


def _repack_module_list(experts_source: nn.Module, spec: MoELayerSpec, start: int, end: int):
    if not isinstance(experts_source, nn.ModuleList):
        raise TypeError(f"Expected nn.ModuleList for module_list storage, got {type(experts_source)}")
    names = (spec.expert_w1_name, spec.expert_w2_name, spec.expert_w3_name)
    stacks: list[list[torch.Tensor]] = [[], [], []]
    # every expert is gathered in order on every rank (gathering is collective), only the local ones are kept
    for index, expert in enumerate(experts_source):
        weights = [_get_expert_weight(expert, n) if n is not None else None for n in names]
        with _gather_source_zero_params(weights):
            if start <= index < end:
                for stack, weight in zip(stacks, weights):
                    if weight is not None:
                        stack.append(weight.data.clone())
    for name, stack in zip(names, stacks):
        if name is None:
            continue
        for index, tensor in enumerate(stack, start=start):
            if (tensor.dtype, tensor.device) != (stack[0].dtype, stack[0].device):
                raise ValueError(f"AutoEP cannot preserve mixed dtype/device for module_list experts {start}:{end} "
                                 f"weight '{name}' because they are packed into one grouped expert tensor. Expected "
                                 f"{stack[0].dtype} on {stack[0].device}, found {tensor.dtype} on {tensor.device} "
                                 f"at expert {index}.")
    w1, w2 = torch.stack(stacks[0]), torch.stack(stacks[1])
    if spec.expert_w3_name is not None:
        return w1, w2, torch.stack(stacks[2])
    ffn = w1.shape[1] // 2  # gate and up fused in each expert's w1
    return w1[:, :ffn, :].contiguous(), w2, w1[:, ffn:, :].contiguous()
