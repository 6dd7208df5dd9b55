"""Quantizing the stored weights after each optimizer step: MoQ (``quantize_training``) and weight
quantization with ``quantize_weight_in_forward: false``.

The model's 16-bit weights are overwritten with their quantized values after every applied step; the
optimizer's fp32 master weights are not, so small updates still accumulate (this is why the mode needs
fp16 or bf16: in fp32 the model's weights are the master weights). Under ZeRO-3 each weight is gathered,
quantized, and each rank keeps its shard of the result.

MoQ's schedule (``quantize_training``): no quantization before ``quantize_schedule.schedule_offset``;
then ``start_bits``; the first period is ``quantize_period`` steps and every later one twice the one
before, one bit fewer at the end of each, down to ``target_bits``: with offset 0 and period 100, 16 -> 15
at step 100, 15 -> 14 at step 300, 14 -> 13 at step 700. With ``eigenvalue.enabled`` the period starting
at a switch is also multiplied by ``1 + floor(4·λ)`` for the weights of a layer whose normalised Hessian
eigenvalue is λ (up to 5x for the most sensitive layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn

from dsrun import comm

from .quantizers import QuantSpec, check_groups, fake_quantize

if TYPE_CHECKING:
    from dsrun.config.misc import QuantizeTrainingConfig

    from .eigenvalue import Eigenvalue


def _is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


def overwrite_with_quantized(params: Iterable[tuple[nn.Parameter, QuantSpec, float]]) -> None:
    """Replace each parameter's value by ``share·Q(w) + (1 - share)·w``; collective under ZeRO-3 (every rank
    must call it with the same parameters in the same order)."""
    from dsrun.zero.partition_params import write_shard
    from dsrun.zero import GatheredParameters

    for param, spec, share in params:
        with GatheredParameters([param] if _is_partitioned(param) else []), torch.no_grad():
            full = param.data
            value = fake_quantize(full, spec)
            if share < 1.0:
                value = share * value + (1.0 - share) * full
            if not _is_partitioned(param):
                param.data.copy_(value)
                continue
            rank = comm.get_rank(param.ds_process_group)
            part = param.ds_partition_numel
            flat = value.reshape(-1)
            shard = torch.zeros(part, dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)
            start, end = min(rank * part, flat.numel()), min((rank + 1) * part, flat.numel())
            shard[: end - start].copy_(flat[start:end])
            write_shard(param, shard)  # the 16-bit shard only: the fp32 master keeps full precision


def moq_switch_steps(offset: int, period: int, start: int, target: int, factors: Callable[[int], int] | None = None
                     ) -> list[int]:
    """The steps at which MoQ drops one bit (no eigenvalue factors unless ``factors(k)`` gives the factor
    applied to the period that starts at switch ``k``)."""
    steps, at, length = [], offset, period
    for k in range(start - target):
        at += length
        steps.append(at)
        length = length * 2 * (factors(k) if factors else 1)
    return steps


@dataclass
class _MoQWeight:
    name: str
    param: nn.Parameter
    layer: int | None  # index of its block for the eigenvalue, if any
    bits: int
    next_switch: int
    period: int
    started: int


class MoQ:
    """The ``quantize_training`` quantizer of one model: every weight with two or more dimensions."""

    def __init__(self, model: nn.Module, config: QuantizeTrainingConfig, eigenvalue: Eigenvalue | None = None):
        self.config = config
        algo = config.quantize_algo
        self.symmetric = algo.q_type == "symmetric"
        self.stochastic = algo.rounding == "stochastic"
        self.groups = config.quantize_groups
        self.offset = config.quantize_schedule.schedule_offset
        self.steps = 0
        self.eigenvalue = eigenvalue
        blocks = eigenvalue.block_of_params(model) if eigenvalue is not None else {}
        bits = config.quantize_bits
        self.weights = []
        for name, p in model.named_parameters():
            shape = getattr(p, "ds_shape", p.shape)
            if len(shape) < 2:
                continue
            check_groups(torch.Size(shape).numel(), self.groups, f"quantize_training.quantize_groups ({name})")
            period = config.quantize_schedule.quantize_period
            self.weights.append(_MoQWeight(name, p, blocks.get(id(p)), bits.start_bits,
                                           self.offset + period, period, self.offset))

    def _share(self, w: _MoQWeight) -> float:
        mixed = self.config.fp16_mixed_quantize
        return min(1.0, mixed.quantize_change_ratio * (self.steps - w.started + 1)) if mixed.enabled else 1.0

    def switch_due(self) -> bool:
        """Will some weight drop a bit at the next step? (When eigenvalues are worth computing.)"""
        target = self.config.quantize_bits.target_bits
        return any(w.bits > target and self.steps + 1 >= w.next_switch for w in self.weights)

    def step(self, eigenvalues: dict[int, float] | None = None) -> None:
        """One optimizer step done: advance the schedule, then quantize the stored weights."""
        self.steps += 1
        self.apply(eigenvalues)

    def apply(self, eigenvalues: dict[int, float] | None = None) -> None:
        if self.steps < self.offset:
            return
        target = self.config.quantize_bits.target_bits
        for w in self.weights:
            if w.bits > target and self.steps >= w.next_switch:
                factor = 1 + int(4 * eigenvalues[w.layer]) if eigenvalues and w.layer in eigenvalues else 1
                w.bits -= 1
                w.started = self.steps
                w.period = w.period * 2 * factor
                w.next_switch = self.steps + w.period
                if self.config.quantize_verbose and (not comm.is_initialized() or comm.get_rank() == 0):
                    print(f"[dsrun] MoQ: {w.name} at {w.bits} bits from step {self.steps}, next period {w.period}",
                          flush=True)
        overwrite_with_quantized(
            (w.param, QuantSpec(w.bits, self.symmetric, self.groups, self.stochastic), self._share(w))
            for w in self.weights)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "weights": {w.name: (w.bits, w.next_switch, w.period, w.started)
                                                 for w in self.weights}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        for w in self.weights:
            if w.name in state["weights"]:
                w.bits, w.next_switch, w.period, w.started = state["weights"][w.name]
