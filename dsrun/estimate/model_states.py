"""Model states per rank: parameters, gradients and optimizer states, by ZeRO stage, offload and precision.

Bytes per parameter (P = all parameters, T = trainable ones, N = data-parallel ranks):

* working parameters ``w`` = 2 (fp16/bf16) or 4 (fp32); working gradients the same ``w``;
* mixed precision adds an fp32 master copy (4) and an fp32 gradient copy the optimizer reads (4);
* optimizer states: 4 bytes each, ``optimizer_state_count`` of them (Adam 2, Lion 1, SGD 0 or 1, ...).

The optimizer step adds one fp32 temporary of the partition it updates on the device (a multi-tensor
step's workspace, e.g. Adam's ``sqrt(v) + eps``), none for stateless SGD or an offloaded (fused) step.

ZeRO partitions, over N ranks: stage 1 the optimizer side (master, fp32 grads, states); stage 2 also the
gradients; stage 3 also the parameters (parameters below the persistence threshold stay whole). Optimizer
offload moves the optimizer side to host RAM (cpu) or NVMe, where the CPU optimizer needs an fp32 copy of
the partition even in fp32 training; with it, stage 2/3 gradients leave the device bucket by bucket.
Parameter offload (stage 3) moves the parameter partition to host RAM or NVMe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dsrun.estimate.inputs import EstimateInputs
from dsrun.utils.errors import ConfigError, Problem
from dsrun.utils.suggest import did_you_mean

FP32 = 4

# DeepSpeed optimizer type (lower case, "_" removed) -> fp32 states per parameter. SGD and RMSprop
# depend on their settings and are handled in optimizer_state_count.
_STATES: dict[str, int] = {
    "adam": 2, "adamw": 2, "fusedadam": 2, "cpuadam": 2, "deepspeedcpuadam": 2,
    "lamb": 2, "fusedlamb": 2, "cpulamb": 2,
    "onebitadam": 3, "zerooneadam": 3, "onebitlamb": 3,  # + error-feedback buffer for compression
    "lion": 1, "fusedlion": 1, "cpulion": 1,
    "adagrad": 1, "cpuadagrad": 1,
    "sgd": 0, "rmsprop": 1,
}


def optimizer_state_count(optimizer: str, params: Mapping[str, Any] | None = None) -> int:
    """How many fp32 tensors of a parameter's size the optimizer keeps per parameter.

    Adam/AdamW/Lamb: 2 (first and second moments); 1-bit Adam/0-1 Adam/1-bit Lamb: 3 (plus the error
    feedback of the compressed all-reduce); Lion, Adagrad: 1; SGD: 1 with ``momentum`` > 0 else 0;
    RMSprop: 1, plus 1 with momentum, plus 1 when ``centered``.
    """
    params = params or {}
    key = optimizer.lower().replace("_", "").replace("-", "")
    if key not in _STATES:
        raise ConfigError(Problem("ds.optimizer.type", f"unknown optimizer {optimizer!r} for the memory estimate",
                                  did_you_mean(key, _STATES) or f"known: {', '.join(sorted(_STATES))}"))
    count = _STATES[key]
    if key == "sgd" and float(params.get("momentum", 0) or 0) > 0:
        count = 1
    if key == "rmsprop":
        count += int(float(params.get("momentum", 0) or 0) > 0) + int(bool(params.get("centered", False)))
    return count


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states for one rank, split by where they live."""

    device_params: int        # working-precision parameters resident on the device (partition or all)
    device_master_params: int  # fp32 master parameters on the device (mixed precision, no offload)
    device_gradients: int     # working gradients + fp32 gradient copy kept on the device
    device_optimizer_states: int
    device_step_workspace: int  # temporaries of the optimizer step on the device
    host: int                 # offloaded optimizer side and parameters in host RAM
    nvme: int                 # offloaded to NVMe
    host_buffers: int         # pinned swap buffers in host RAM for NVMe offload

    @property
    def device_total(self) -> int:
        return self.device_params + self.device_master_params + self.device_gradients + self.device_optimizer_states


def _ceil_div(count: int, parts: int) -> int:
    return -(-count // parts)


def model_state_bytes(spec: EstimateInputs) -> ModelStates:
    """Model-state bytes per rank for ``spec`` (see the module docstring for the rules)."""
    n = spec.world_size
    stage = spec.zero_stage
    w = 2 if spec.mixed_precision else FP32
    master = FP32 if spec.mixed_precision else 0
    grad32 = FP32 if spec.mixed_precision else 0
    states = FP32 * optimizer_state_count(spec.optimizer, spec.optimizer_params)
    total, trainable = spec.total_params, spec.trainable

    # Parameters: whole below stage 3; at stage 3 the small ones stay whole and the rest is partitioned.
    small = min(spec.small_params, total)
    if stage < 3:
        param_elems = total
    else:
        param_elems = _ceil_div(total - small, n) + small
    t_part = _ceil_div(trainable, n) if stage >= 1 else trainable
    grad_elems = trainable if stage <= 1 else _ceil_div(trainable, n)

    host = nvme = host_buffers = 0
    device_params = param_elems * w
    if spec.offload_param != "none":
        partition = _ceil_div(total - small, n) * w
        device_params = small * w
        if spec.offload_param == "cpu":
            host += partition
        else:
            nvme += partition
            pool = spec.buffers.offload_param_buffer_count * spec.buffers.offload_param_buffer_size
            host_buffers += min(pool, _ceil_div(total - small, n)) * w

    step_workspace = 0
    if spec.offload_optimizer == "none":
        device_master = t_part * master
        device_grads = grad_elems * w + t_part * grad32
        device_states = t_part * states
        # A multi-tensor (foreach) step builds one fp32 temporary the size of what it updates, e.g. Adam's
        # sqrt(v) + eps; optimizers without state update in place. The CPU optimizer (offload) is fused.
        step_workspace = t_part * FP32 if states else 0
    else:
        device_master = device_states = 0
        # Stage 1 accumulates whole gradients on the device; stages 2-3 stream them out per bucket.
        device_grads = trainable * w if stage == 1 else 0
        if spec.offload_optimizer == "cpu":
            host += t_part * (FP32 + FP32 + states)  # fp32 params, fp32 grads, states
        else:
            host += t_part * FP32  # fp32 gradients are gathered in RAM before being swapped with the states
            nvme += t_part * (FP32 + states)
            chunk = min(t_part, spec.buffers.sub_group_size)
            host_buffers += spec.buffers.offload_optimizer_buffer_count * chunk * FP32
    return ModelStates(device_params=device_params, device_master_params=device_master,
                       device_gradients=device_grads, device_optimizer_states=device_states,
                       device_step_workspace=step_workspace, host=host, nvme=nvme, host_buffers=host_buffers)


def init_bytes_per_rank(spec: EstimateInputs) -> int:
    """Host RAM a rank needs while building the model: the whole model in fp32, unless ZeRO-3's
    ``zero.Init`` partitions it as it is built (then the partition plus one whole layer)."""
    if spec.zero_stage == 3 and spec.zero_init:
        return (_ceil_div(spec.total_params, spec.world_size) + spec.largest_layer_params) * FP32
    return spec.total_params * FP32
