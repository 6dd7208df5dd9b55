"""Model states per rank: parameters, gradients and optimizer states, by ZeRO stage, offload and precision.

Bytes per parameter (P = all parameters, T = trainable ones, N = data-parallel ranks, w = 2 in fp16/bf16
or 4 in fp32, k = ``optimizer_state_count``), as dsrun's ZeRO strategies hold them (checked against the
engine's own ``memory_breakdown()`` for stages 0-3 on 1 and 2 ranks, fp32 and bf16):

=====  =====================  ======================  ==============================  ===========
stage  parameters             fp32 master copy        gradients                       states
=====  =====================  ======================  ==============================  ===========
0      ``P*w``                ``4T`` if mixed         ``T*w`` (+ ``4T`` if mixed)     ``4kT``
1      ``P*w``                ``4T/N``                ``T*w + 4T/N`` (+ ``wT/N`` if   ``4kT/N``
                                                      mixed: the received piece)
2      ``P*w``                ``4T/N``                ``4T/N`` (fp32 accumulator)     ``4kT/N``
3      ``(P/N + small)*w``    ``4T/N`` if mixed       ``4T/N``                        ``4kT/N``
=====  =====================  ======================  ==============================  ===========

At stage 3, MiCS (``mics_shard_size`` S) partitions over S ranks: N is S in every column. hpZ
(``zero_hpz_partition_size`` H) adds the secondary parameter partition, ``P*w/H``. With
``zero_quantized_nontrainable_weights`` the frozen part of the partition, ``(P-T)/N`` elements, is kept as
INT8 codes plus one fp32 scale per 256 (``dsrun.comm.quantized.message_bytes``) instead of ``w`` bytes each.
LoCo (``zeropp_loco_param`` beside qgZ) adds its INT8 error buffers to the gradient column: about ``T`` bytes
(every bucket's rows), and ``nodes*T/N`` more across nodes (:func:`loco_error_bytes`).

``data_types.grad_accum_dtype`` naming another dtype (``a`` bytes) than the stage's own (ZeRO 1-3, on the device):
stage 1 adds a whole accumulator, ``T*a``, and holds the reduced partition in that dtype, ``a*T/N`` (plus the
masters' gradient, ``m*T/N``, when ``a`` is not the masters' ``m``); stages 2-3 hold their partition accumulator
in it, ``a*T/N`` instead of ``m*T/N``, and the step reads a copy in the masters' dtype (``m*T/N`` of workspace).

Stages 1-2 step an fp32 clone of the partition even in fp32 training; stage 3 in fp32 steps its fp32
partition directly.

bf16 master state (``bf16_master_weights_and_grads`` with ``bf16_optimizer_states``, stages 1-3 on the device)
puts 2 bytes where the table has 4 in the master, gradient and state columns, and drops what only existed to
hold fp32: stage 1's reduced bf16 piece is the masters' gradient itself (``T*w + wT/N``), and stage 3's bf16
shards are the masters (no master column). With Adam on one rank, bytes per weight go from 22 to 12 at stage 1,
18 to 10 at stage 2 and 18 to 8 at stage 3 (without stage 3's gathered small parameters). ``small`` = parameters below ``stage3_param_persistence_threshold``, kept gathered on
every rank besides their share of the partition. On CUDA the optimizer step adds one fp32 temporary of the
partition it updates (a multi-tensor step's workspace, e.g. Adam's ``sqrt(v) + eps``), none for stateless
SGD or an offloaded (fused) step; on the CPU none for the fused compiled Adam/Lion/Adagrad and one of the
largest layer for torch's per-tensor optimizers. With ``gradient_clipping`` the ZeRO-3 step computes the
norm of each fp32 sub-group's gradient a chunk of ``NORM_CHUNK`` (2**20) elements at a time, through a float64
copy and its square: ``16 * min(T/N, sub_group_size, NORM_CHUNK)`` bytes, the larger of the two.

The 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb; stages 0-1) add their error-feedback buffers to
the states: the worker error, ``4T`` on every rank (each rank's own, never partitioned), and the server
error, ``4T/N`` (this rank's chunk). Their states are Adam's two moments, plus 0/1 Adam's synchronised
weights or 1-bit LAMB's fresh variance (3); their compressed exchange builds two fp32 temporaries of the
whole flat group (the compensated input and its decoded copy), ``8T``, counted as step workspace.

fp16 master state (``fp16_master_weights_and_grads``: fp16, stages 1-3, optimizer offload to cpu) keeps the host
masters and their gradients in fp16 (2 bytes each where the offload below has 4; the moments stay fp32); at
stage 3 on a CPU device the fp16 shards are views of the masters (no master column).

Parameters kept fp32 (``data_types.keep_in_fp32_modules`` under fp16/bf16: K elements, ``Kt`` of them trainable)
take 4 bytes where the table has ``w`` in the parameter column (stage 3: their partition ``K/N``, hpZ's secondary
``K/H``, an offloaded partition) and in the 16-bit gradients (stages 0-1: ``Kt``; stage 1's received piece
``Kt/N``; NVMe's gradient files): :func:`kept_fp32_extra_bytes`. Their masters, fp32 gradients and states are as
every other parameter's.

Optimizer offload moves master copy, fp32 gradients and states to host RAM (cpu) or NVMe; the CPU
optimizer needs an fp32 copy of the partition even in fp32 training; with it, stage 2/3 gradients leave
the device bucket by bucket. NVMe keeps master, states and gradients in files; host RAM then holds only
``buffer_count`` swap buffers of one sub-group (``min(T/N, sub_group_size)`` fp32 elements each) and, for
a 16-bit model, the step's 16-bit output per pipeline slot. When ranks run on the CPU, host RAM is also
the device's memory, so CPU offload moves bytes without saving any; NVMe saves what it moves to files
minus its buffers. Parameter offload (stage 3) moves the parameter partition to host RAM or NVMe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dsrun.comm.quantized import GRAD_BLOCK, WEIGHT_BLOCK, message_bytes
from dsrun.estimate.inputs import EstimateInputs, ceil_div
from dsrun.offload.nvme import NORM_CHUNK
from dsrun.utils.errors import ConfigError, Problem
from dsrun.utils.suggest import did_you_mean

FP32 = 4

# DeepSpeed optimizer type (lower case, "_" removed) -> fp32 states per parameter. SGD and RMSprop
# depend on their settings and are handled in optimizer_state_count.
_STATES: dict[str, int] = {
    "adam": 2, "adamw": 2, "fusedadam": 2, "cpuadam": 2, "deepspeedcpuadam": 2,
    "lamb": 2, "fusedlamb": 2, "cpulamb": 2,
    "onebitadam": 2, "zerooneadam": 3, "onebitlamb": 3,  # + the error buffers: error_feedback_bytes
    "lion": 1, "fusedlion": 1, "cpulion": 1,
    "adagrad": 1, "cpuadagrad": 1,
    "sgd": 0, "rmsprop": 1,
    # Muon: the auxiliary Adam's two moments, an upper bound for the hidden matrices, whose one momentum buffer is
    # held once across the data-parallel group at every stage (docs/muon.md)
    "muon": 2, "muonwithauxadam": 2,
}


def optimizer_state_count(optimizer: str, params: Mapping[str, Any] | None = None) -> int:
    """How many fp32 tensors of a parameter's size the optimizer keeps per parameter.

    Adam/AdamW/Lamb and 1-bit Adam: 2 (first and second moments); 0/1 Adam: 3 (plus the synchronised
    weights); 1-bit Lamb: 3 (plus the fresh variance); the 1-bit optimizers' error buffers are
    :func:`error_feedback_bytes`; Lion, Adagrad: 1; SGD: 1 with ``momentum`` > 0 else 0;
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


ONE_BIT = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})


def error_feedback_bytes(spec: EstimateInputs) -> int:
    """The 1-bit optimizers' error buffers on one rank: the worker error over every trainable element and the
    server error over this rank's chunk (0 for other optimizers)."""
    if spec.optimizer.lower().replace("_", "").replace("-", "") not in ONE_BIT:
        return 0
    return spec.trainable * FP32 + ceil_div(spec.trainable, spec.data_parallel_size) * FP32


def loco_error_bytes(spec: EstimateInputs, n: int, t_part: int) -> int:
    """LoCo's error buffers beside qgZ (stage 3, ``zeropp_loco_param``): INT8 codes and fp32 block scales of
    every bucket's rows (``n`` x its partition: ``n * T/n`` elements) and, across several nodes, of the node's
    partial sums (``nodes * T/n``)."""
    if spec.zero_stage != 3 or not spec.buffers.zeropp_loco or n == 1:
        return 0
    two_stage = spec.nodes > 1 and n == spec.data_parallel_size  # hierarchical only over the whole world
    elems = n * t_part + (spec.nodes * t_part if two_stage else 0)
    return message_bytes(elems, 8, GRAD_BLOCK)


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


def _fused_on_cpu(optimizer: str) -> bool:
    """Optimizers dsrun steps with a fused compiled op when ranks run on the CPU (no step temporaries)."""
    key = optimizer.lower().replace("_", "").replace("-", "")
    return key in {"adam", "adamw", "cpuadam", "deepspeedcpuadam", "lion", "cpulion", "adagrad", "cpuadagrad"}


def zenflow_selected_bytes(t_part: int, topk_ratio: float) -> int:
    """ZenFlow's per-element state of the columns it selects: fp32 weight, two fp32 moments, an int64 index
    (matrices' columns are ``topk_ratio`` of the elements; 1-D parameters, always selected, are not counted)."""
    return int(topk_ratio * t_part) * (3 * FP32 + 8)


def model_state_bytes(spec: EstimateInputs) -> ModelStates:
    """Model-state bytes per rank for ``spec`` (see the module docstring for the rules)."""
    n = spec.partition_ranks  # MiCS: the shard group
    stage = spec.zero_stage
    mixed = spec.mixed_precision
    w = 2 if mixed else FP32
    m = spec.master_element_bytes  # masters and their gradients: fp32, or bf16 with bf16 master state
    low = spec.bf16_master_state
    # fp32 master copy: always in mixed precision; in fp32 the partitioned stages 1-2 step a clone. bf16 masters:
    # a bf16 clone at stages 1-2; at stage 3 the bf16 shards themselves.
    master = m if mixed or stage in (1, 2) else 0
    if stage == 3 and low:
        master = 0
    if stage == 3 and spec.offload_param == "nvme":
        master = FP32  # fp32 too: the model's shards are in files, the optimizer steps an fp32 copy
    states = spec.state_element_bytes * optimizer_state_count(spec.optimizer, spec.optimizer_params)
    total, trainable = spec.total_params, spec.trainable

    # Parameters: whole below stage 3; at stage 3 the partition plus the small ones kept gathered.
    small = min(spec.small_params, total)
    param_elems = total if stage < 3 else ceil_div(total, n) + small
    if spec.hpz_ranks:  # hpZ: the secondary partition the backward gathers from
        param_elems += ceil_div(total, spec.hpz_ranks)
    t_part = ceil_div(trainable, n) if stage >= 1 else trainable
    a = spec.accumulator_element_bytes  # data_types.grad_accum_dtype's accumulator, where it is not the stage's own
    if a is not None and stage == 1:  # working gradients, the whole accumulator, its reduced partition in its
        # dtype, and the masters' gradient when that dtype is not the masters'
        grad_bytes = trainable * w + trainable * a + t_part * a + (t_part * m if a != m else 0)
    elif a is not None:  # stages 2-3: the partition accumulator in that dtype
        grad_bytes = t_part * a
    elif stage == 0:
        grad_bytes = trainable * w + (trainable * FP32 if mixed else 0)
    elif stage == 1 and low:  # whole working gradients and the received piece, which the bf16 masters step on
        grad_bytes = trainable * w + t_part * w
    elif stage == 1:  # whole working gradients, the fp32 partition, and (16-bit) the received piece
        grad_bytes = trainable * w + t_part * FP32 + (t_part * w if mixed else 0)
    else:  # only the partition accumulator (fp32, or bf16 with bf16 master state)
        grad_bytes = t_part * m

    host = nvme = host_buffers = 0
    device_params = param_elems * w
    frozen = total - trainable
    if stage == 3 and spec.buffers.zero_quantized_nontrainable_weights and frozen:  # frozen shards kept INT8
        device_params += message_bytes(ceil_div(frozen, n), 8, WEIGHT_BLOCK) - ceil_div(frozen, n) * w
    if spec.offload_param != "none":
        partition = ceil_div(total, n) * w
        device_params = small * w
        if spec.offload_param == "cpu":
            host += partition
        else:
            nvme += partition
            # the read/write pool (buffer_count x buffer_size elements, each allocated whole when first
            # needed) and the shards that may stay cached in host memory (max_in_cpu elements)
            pool = spec.buffers.offload_param_buffer_count * spec.buffers.offload_param_buffer_size
            cached = min(spec.buffers.offload_param_max_in_cpu, ceil_div(total, n))
            host_buffers += (pool + cached) * w

    step_workspace = 0
    if spec.offload_optimizer == "none":
        device_master = t_part * master
        device_grads = grad_bytes
        device_states = t_part * states + error_feedback_bytes(spec)
        # On CUDA a multi-tensor (foreach) step builds one fp32 temporary the size of what it updates, e.g.
        # Adam's sqrt(v) + eps; optimizers without state update in place. On the CPU dsrun steps Adam, Lion
        # and Adagrad with its fused compiled ops (no temporary), and torch's optimizers go tensor by tensor
        # (foreach is off on the CPU): at most one temporary of the largest layer.
        # (the temporary takes the states' dtype: bf16 with bf16_optimizer_states)
        if not states:
            step_workspace = 0
        elif spec.device == "cuda":
            step_workspace = t_part * spec.state_element_bytes
        elif _fused_on_cpu(spec.optimizer):
            step_workspace = 0
        else:
            step_workspace = min(t_part, spec.largest_layer_params) * spec.state_element_bytes
        if error_feedback_bytes(spec):
            step_workspace = max(step_workspace, 2 * trainable * FP32)  # the compressed exchange's input, output
        if a is not None and stage >= 2 and a != m:  # the step reads a copy of the accumulator in the masters' dtype
            step_workspace += t_part * m
        if stage == 3 and spec.gradient_clipping > 0:
            # the ZeRO-3 step's gradient norm: a float64 copy of a chunk of a sub-group's gradient and its square
            step_workspace = max(step_workspace, 16 * min(t_part, spec.buffers.sub_group_size, NORM_CHUNK))
    else:
        device_master = device_states = 0
        # Stage 1 accumulates whole gradients on the device; stages 2-3 stream them out per bucket.
        device_grads = trainable * w if stage == 1 else 0
        if spec.offload_optimizer == "cpu" and spec.fp16_master_state:
            # fp16 masters and gradients, fp32 moments; at stage 3 on a CPU device the fp16 shards are views of
            # the masters (dsrun.offload.shard_store: aliased), so the masters' bytes are the parameters'
            aliased = stage == 3 and spec.device == "cpu" and spec.offload_param == "none"
            host += t_part * ((0 if aliased else 2) + 2 + states)
        elif spec.offload_optimizer == "cpu":
            host += t_part * (FP32 + FP32 + states)  # fp32 params, fp32 grads, states
            if spec.zenflow is not None and stage in (1, 2):  # dsrun.offload.zenflow_store
                selected = zenflow_selected_bytes(t_part, spec.zenflow.topk_ratio)
                device_states += 0 if spec.zenflow.offload else selected
                host += (selected if spec.zenflow.offload else 0) + t_part * FP32 * (2 if spec.zenflow.overlap_step
                                                                                      else 1)
        else:
            # dsrun.offload.nvme: master, gradient and states of each sub-group in swap files (the
            # gradient in the 16-bit model dtype when each step is one micro-step, else fp32);
            # resident: buffer_count fp32 buffers of one sub-group, and (16-bit model) one 16-bit output
            # per pipeline slot (a slot = master + gradient + states buffers, at most 3 slots)
            grad_file = w if mixed and spec.gradient_accumulation_steps == 1 else FP32
            nvme += t_part * (FP32 + grad_file + states)
            chunk = min(t_part, spec.buffers.sub_group_size)
            count = spec.buffers.offload_optimizer_buffer_count
            host_buffers += count * chunk * FP32
            if mixed:
                slots = max(1, min(3, count // (2 + states // FP32)))
                host_buffers += slots * chunk * w
    device_grads += loco_error_bytes(spec, n, t_part)
    extra = kept_fp32_extra_bytes(spec)
    device_params += extra["device_params"]
    device_grads += extra["device_gradients"]
    host, nvme = host + extra["host"], nvme + extra["nvme"]
    return ModelStates(device_params=device_params, device_master_params=device_master,
                       device_gradients=device_grads, device_optimizer_states=device_states,
                       device_step_workspace=step_workspace, host=host, nvme=nvme, host_buffers=host_buffers)


def kept_fp32_extra_bytes(spec: EstimateInputs) -> dict[str, int]:
    """What the parameters kept fp32 (``kept_fp32_params``) add over the table's 16-bit counting: 2 more bytes per
    element where a 16-bit model holds them at ``w`` (see the module docstring), by where they live."""
    extra = {"device_params": 0, "device_gradients": 0, "host": 0, "nvme": 0}
    if not spec.mixed_precision or not spec.kept_fp32_params:
        return extra
    x, stage, n = FP32 - 2, spec.zero_stage, spec.partition_ranks
    kept, kept_t = spec.kept_fp32_params, spec.kept_trainable
    kept_part = ceil_div(kept, n) if stage == 3 else kept
    where = {"none": "device_params", "cpu": "host", "nvme": "nvme"}[spec.offload_param if stage == 3 else "none"]
    extra[where] += kept_part * x
    if stage == 3 and spec.hpz_ranks:
        extra["device_params"] += ceil_div(kept, spec.hpz_ranks) * x
    if stage in (0, 1):  # the whole 16-bit gradients: the kept ones fp32
        extra["device_gradients"] += kept_t * x
    if stage == 1 and spec.offload_optimizer == "none" and spec.accumulator_element_bytes is None:
        extra["device_gradients"] += ceil_div(kept_t, n) * x  # the received piece: fp32 for the kept group
    if spec.offload_optimizer == "nvme" and spec.gradient_accumulation_steps == 1:  # gradient files in the model
        extra["nvme"] += ceil_div(kept_t, n) * x  # dtype: fp32 for the kept
    return extra


def init_bytes_per_rank(spec: EstimateInputs) -> int:
    """Host RAM a rank needs while building the model: the whole model in fp32 (with AutoTP the unsplit model,
    which is broadcast and then cut), unless ZeRO-3's ``zero.Init`` partitions it as it is built (then the
    partition plus one whole layer)."""
    if spec.zero_stage == 3 and spec.zero_init:
        return (ceil_div(spec.total_params, spec.partition_ranks) + spec.largest_layer_params) * FP32
    return spec.built_params * FP32


def checkpoint_bytes(spec: EstimateInputs) -> int:
    """Bytes of one checkpoint of the whole run, every rank's files together: the module's weights in the working
    precision, and for the trainable parameters the master copy (a tensor of its own in mixed precision and at
    ZeRO stages 1-3; fp32, or bf16 with bf16 master state) and the optimizer's states (in their dtype). A lower
    bound: buffers, RNG states, the 1-bit optimizers' error buffers and the client state are left out.
    ``dsrun train`` sets it against ``train.preemption.grace_s``."""
    w = 2 if spec.mixed_precision else FP32
    trainable, states = spec.trainable, optimizer_state_count(spec.optimizer, spec.optimizer_params)
    master = spec.master_element_bytes * trainable if spec.mixed_precision or spec.zero_stage > 0 else 0
    kept = spec.kept_fp32_params * (FP32 - w)  # keep_in_fp32_modules: those weights are saved in fp32
    return spec.total_params * w + kept + master + spec.state_element_bytes * states * trainable
