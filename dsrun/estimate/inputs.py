"""The numbers a memory estimate is computed from.

:class:`EstimateInputs` holds everything :func:`dsrun.estimate.estimate_peak_bytes_per_rank` needs: the
model's parameter counts (and, for activations, its GPT shape), the hardware layout, and the DeepSpeed
settings that change memory (ZeRO stage, offload, precision, optimizer, bucket sizes). It is plain data,
so the CLI builds it from a recipe and the autotuner builds it from a trial's settings without a model.
Invalid values raise :class:`~dsrun.utils.errors.ConfigError` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping

from dsrun.activation_checkpointing.modes import CheckpointMode
from dsrun.utils.errors import ConfigError, Problem

Precision = Literal["fp32", "fp16", "bf16"]
Offload = Literal["none", "cpu", "nvme"]
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16")
OFFLOADS: tuple[str, ...] = ("none", "cpu", "nvme")
# DeepSpeed's (and dsrun.config's) default ``gradient_clipping``; kept here so the estimator imports no pydantic
# (tests/unit/estimate/test_runspec.py checks that the two agree)
DEFAULT_CLIPPING = 1.0


def ceil_div(count: int, parts: int) -> int:
    """``count / parts`` rounded up (a partition's size)."""
    return -(-count // parts)


@dataclass(frozen=True)
class GPTShape:
    """The shape of a GPT-style decoder, enough to count its activations.

    ``ffn_hidden`` defaults to ``4 * n_embd``. ``flash_attention``: attention through a fused kernel
    (``scaled_dot_product_attention``) that saves no ``seq x seq`` score matrix; False for the explicit
    softmax(QK^T)V that keeps it. ``dropout``: dropout layers active (each keeps a one-byte mask).
    ``rotary``: rotary position embeddings (the rotated queries and keys are new tensors, and the attention
    output gets copied once more on its way to the output projection). ``tied_embeddings``: the output head
    shares the token embedding's weight, whose gradient is then summed at the end of backward.
    """

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    ffn_hidden: int | None = None
    flash_attention: bool = True
    dropout: bool = False
    rotary: bool = False
    tied_embeddings: bool = False

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.n_embd


@dataclass(frozen=True)
class BufferSettings:
    """The ZeRO communication and offload buffer settings, in elements (DeepSpeed's keys and defaults).

    ``overlap_comm`` None means DeepSpeed's default: on for stage 3, off otherwise (double buffering of
    the reduce bucket when on). The offload buffer pools matter only for NVMe offload.
    """

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    offload_param_buffer_count: int = 5
    offload_param_buffer_size: int = 100_000_000
    offload_param_max_in_cpu: int = 1_000_000_000
    offload_optimizer_buffer_count: int = 4
    zero_quantized_weights: bool = False  # ZeRO++ qwZ: stage-3 gathers carry INT8 blocks (dsrun/comm/quantized.py)
    zero_quantized_gradients: bool = False  # ZeRO++ qgZ: the gradient reduce-scatter is an INT4 all-to-all
    zero_quantized_nontrainable_weights: bool = False  # frozen stage-3 shards kept (and gathered) as INT8 blocks
    stage3_use_all_reduce_for_fetch_params: bool = False  # exact stage-3 fetches as all-reduces: twice the traffic
    zeropp_loco: bool = False  # LoCo's INT8 error buffers beside qgZ (zeropp_loco_param)

    @classmethod
    def from_zero_config(cls, zero: Mapping[str, Any]) -> "BufferSettings":
        """Read the settings from a ``zero_optimization`` section (the schema's defaults for missing keys)."""
        from dsrun.config import ds_section

        typed = ds_section({"zero_optimization": dict(zero)}, "zero_optimization")
        # overlap_comm left unset stays None ("on for stage 3" follows the stage the estimate is asked for),
        # where the schema settles it for the section's own stage
        overlap = typed.overlap_comm if zero.get("overlap_comm") is not None else None
        param, optimizer = typed.offload_param, typed.offload_optimizer
        return cls(
            reduce_bucket_size=int(typed.reduce_bucket_size),
            allgather_bucket_size=int(typed.allgather_bucket_size),
            overlap_comm=overlap,
            reduce_scatter=bool(typed.reduce_scatter),
            stage3_prefetch_bucket_size=int(typed.stage3_prefetch_bucket_size),
            stage3_max_live_parameters=int(typed.stage3_max_live_parameters),
            stage3_param_persistence_threshold=int(typed.stage3_param_persistence_threshold),
            sub_group_size=int(typed.sub_group_size),
            offload_param_buffer_count=int(param.buffer_count),
            offload_param_buffer_size=int(param.buffer_size),
            offload_param_max_in_cpu=int(param.max_in_cpu),
            offload_optimizer_buffer_count=int(optimizer.buffer_count),
            zero_quantized_weights=bool(typed.zero_quantized_weights),
            zero_quantized_gradients=bool(typed.zero_quantized_gradients),
            zero_quantized_nontrainable_weights=bool(typed.zero_quantized_nontrainable_weights),
            stage3_use_all_reduce_for_fetch_params=bool(typed.stage3_use_all_reduce_for_fetch_params),
            zeropp_loco=typed.zeropp_loco_param is not None and bool(typed.zero_quantized_gradients),
        )


@dataclass(frozen=True)
class EstimateInputs:
    """Inputs of :func:`~dsrun.estimate.estimate_peak_bytes_per_rank` (all counts in elements).

    Model: ``total_params`` (shared parameters once), ``largest_layer_params`` (most parameters one module
    owns), ``trainable_params`` (None: all; frozen ones get no gradients or optimizer states),
    ``small_params`` (parameters below ``stage3_param_persistence_threshold``, kept whole on every rank
    by ZeRO-3), ``model_shape`` (a :class:`GPTShape`; None: activations are not estimated).
    Layout: ``ranks_per_node`` x ``nodes`` data-parallel ranks. ZeRO: ``zero_stage`` 0-3,
    ``offload_optimizer`` / ``offload_param`` in none/cpu/nvme. Training: ``precision`` fp32/fp16/bf16,
    ``optimizer`` (a DeepSpeed optimizer type, e.g. ``AdamW``) with its ``optimizer_params`` (SGD's
    ``momentum`` decides whether it keeps a state), ``micro_batch_size``, ``seq_len``,
    ``activation_checkpointing`` (``none``, ``full``, ``every_N`` or ``selective``, the GPT's
    ``model.activation_checkpointing``; a bool means full/none), ``buffers`` (bucket sizes),
    ``zero_init`` (ZeRO-3 builds the model partitioned, so no rank ever holds all of it),
    ``runtime_overhead_bytes`` (device memory outside tensors you want counted, e.g. a CUDA context).
    Process (host RAM of each rank): ``device`` "cpu" (ranks compute on the CPU and talk over gloo, so
    device memory *is* the process's RAM) or "cuda" (NCCL); ``rank_runtime_bytes`` (the resident memory of
    an idle rank: interpreter, libraries, process group, optimizer machinery; measured by
    :func:`dsrun.estimate.runtime.measure_rank_runtime`, 0 = not counted); ``data_bytes`` (the data
    pipeline's resident share: the memory-mapped token array); ``monitor_bytes`` (what rank 0's monitors hold,
    measured by the same probe; 0 on the other ranks). ``gradient_clipping`` (DeepSpeed's key; > 0
    makes the ZeRO-3 step compute the gradient norm, whose temporaries count). ``gradient_accumulation_steps``
    (1 with a 16-bit model: NVMe optimizer offload writes the gradient files in the model dtype).
    ``sequence_parallel_size`` (Ulysses: each rank's activations are 1/P of the sequence's; ZeRO still
    partitions over every rank).
    ``tensor_parallel_size`` T (AutoTP, ``tensor_parallel.autotp_size``): groups of T consecutive ranks split the
    Transformer blocks' matrices (docs/autotp.md). The parameter counts above are then one rank's share (its slices
    and the whole embeddings, norms and head), ZeRO partitions over the ``world_size / T`` data-parallel ranks,
    and each block's per-head and MLP-wide activations are 1/T; ``unsplit_params`` is the whole model's count,
    which every rank builds (and broadcasts) before the split.
    ZeRO-3 layouts: ``mics_shard_size`` (MiCS: model states partitioned over groups of that many ranks
    instead of all of them; -1 off) and ``hpz_partition_size`` (hpZ: each rank also keeps a secondary
    partition of the parameters over that many ranks; 1 off).
    bf16 master state (DeepSpeed's ``bf16`` keys; counted where a run keeps it, :attr:`bf16_master_state`):
    ``bf16_master_weights_and_grads`` (masters and their gradients in bf16) and ``bf16_optimizer_states`` (the
    optimizer's states in bf16). fp16 master state (``fp16_master_weights_and_grads``, counted where a run keeps it,
    :attr:`fp16_master_state`: fp16, ZeRO 1-3, the optimizer offloaded to cpu): the host masters and their gradients
    in fp16, the moments fp32.
    ZenFlow (``zenflow``, the ``zero_optimization.zenflow`` section, stages 1-2 with cpu optimizer offload):
    the selected elements' fp32 weights, two moments and int64 indices with the device's optimizer states (in
    host RAM with its ``offload``), and the window's fp32 gradient accumulator in host RAM (two with
    ``overlap_step``).
    Kept fp32 (``data_types.keep_in_fp32_modules`` with fp16/bf16): ``kept_fp32_params`` elements of the parameters
    stay fp32, ``kept_fp32_trainable`` of them trainable (None: all); their parameters and model-dtype gradients
    take 4 bytes each instead of 2.
    """

    total_params: int
    largest_layer_params: int
    ranks_per_node: int = 1
    nodes: int = 1
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    precision: str = "fp32"
    optimizer: str = "adam"
    optimizer_params: Mapping[str, Any] = field(default_factory=dict)
    micro_batch_size: int = 1
    seq_len: int = 1024
    activation_checkpointing: str = "none"
    model_shape: GPTShape | None = None
    trainable_params: int | None = None
    small_params: int = 0
    buffers: BufferSettings = field(default_factory=BufferSettings)
    zero_init: bool = True
    runtime_overhead_bytes: int = 0
    device: str = "cuda"
    rank_runtime_bytes: int = 0
    data_bytes: int = 0
    monitor_bytes: int = 0
    gradient_clipping: float = DEFAULT_CLIPPING
    gradient_accumulation_steps: int = 1
    sequence_parallel_size: int = 1
    mics_shard_size: int = -1
    hpz_partition_size: int = 1
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    fp16_master_weights_and_grads: bool = False
    grad_accum_dtype: str | None = None  # data_types.grad_accum_dtype ("fp32"/"fp16"/"bf16"; None: the stage's own)
    tensor_parallel_size: int = 1
    unsplit_params: int | None = None
    zenflow: Any = None  # the zero_optimization.zenflow section (dsrun.config.recent.ZenFlowConfig) or None
    kept_fp32_params: int = 0  # data_types.keep_in_fp32_modules: elements of the parameters kept fp32
    kept_fp32_trainable: int | None = None  # ... of those, the trainable ones (None: all)

    def __post_init__(self) -> None:
        try:  # stored in its canonical spelling: "none", "full", "every_2", "selective"
            object.__setattr__(self, "activation_checkpointing",
                               str(CheckpointMode.parse(self.activation_checkpointing, "activation_checkpointing")))
        except ConfigError as err:
            raise ConfigError(err.problems) from None
        problems = list(self._problems())
        if problems:
            raise ConfigError(problems)

    def _problems(self):
        for name in ("total_params", "largest_layer_params", "ranks_per_node", "nodes", "micro_batch_size",
                     "seq_len"):
            value = getattr(self, name)
            low = 0 if name.endswith("params") else 1
            if not isinstance(value, int) or value < low:
                yield Problem(name, f"must be an integer >= {low}, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            yield Problem("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.precision not in PRECISIONS:
            yield Problem("precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOADS:
                yield Problem(f"zero_optimization.{name}.device",
                              f"must be one of {', '.join(OFFLOADS)}, got {getattr(self, name)!r}")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            yield Problem("zero_optimization.offload_optimizer", "needs ZeRO stage 1, 2 or 3",
                          "set zero_optimization.stage")
        if self.offload_optimizer == "nvme" and self.zero_stage != 3:
            yield Problem("zero_optimization.offload_optimizer.device", "nvme needs ZeRO stage 3")
        if self.offload_param != "none" and self.zero_stage != 3:
            yield Problem("zero_optimization.offload_param", "needs ZeRO stage 3")
        if self.device not in ("cpu", "cuda"):
            yield Problem("device", f"must be cpu or cuda, got {self.device!r}")
        for name in ("rank_runtime_bytes", "data_bytes", "monitor_bytes", "runtime_overhead_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                yield Problem(name, f"must be an integer >= 0, got {getattr(self, name)!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1 or self.world_size % tp:
            yield Problem("tensor_parallel.autotp_size", f"got {tp!r}; it must divide the {self.world_size} ranks")
            return
        for name, key in (("mics_shard_size", "mics_shard_size"), ("hpz_partition_size", "zero_hpz_partition_size")):
            size = getattr(self, name)
            if size > 1 and self.data_parallel_size % size:
                yield Problem(f"zero_optimization.{key}", f"got {size}; it must divide the {self.data_parallel_size} "
                              "ranks" + (f" ZeRO partitions over ({self.world_size} / tensor_parallel.autotp_size "
                                         f"{tp})" if tp > 1 else ""))
        if self.partition_ranks < self.data_parallel_size and self.hpz_ranks:  # as the engine refuses it
            yield Problem("zero_optimization.zero_hpz_partition_size", "hpZ and MiCS (mics_shard_size) cannot be "
                          "combined", "set one of them")
        if self.trainable_params is not None and not 0 <= self.trainable_params <= self.total_params:
            yield Problem("trainable_params", f"must be between 0 and total_params, got {self.trainable_params}")
        if not 0 <= self.kept_fp32_params <= self.total_params:
            yield Problem("kept_fp32_params", f"must be between 0 and total_params, got {self.kept_fp32_params}")
        elif not 0 <= self.kept_trainable <= min(self.kept_fp32_params, self.trainable):
            yield Problem("kept_fp32_trainable", f"must be between 0 and kept_fp32_params and the trainable "
                          f"parameters, got {self.kept_trainable}")

    @property
    def checkpoint_mode(self) -> CheckpointMode:
        return CheckpointMode.parse(self.activation_checkpointing)

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def data_parallel_size(self) -> int:
        """The ranks ZeRO reduces and partitions over: every rank, or with AutoTP the ``world_size / T`` ranks
        at one position of their tensor-parallel groups."""
        return self.world_size // max(1, self.tensor_parallel_size)

    @property
    def partition_ranks(self) -> int:
        """The ranks model states are partitioned over: a MiCS shard group at stage 3, else all data-parallel
        ranks."""
        if self.zero_stage == 3 and 0 < self.mics_shard_size < self.data_parallel_size:
            return self.mics_shard_size
        return self.data_parallel_size

    @property
    def hpz_ranks(self) -> int:
        """The ranks of an hpZ secondary parameter partition (0: none)."""
        size = self.hpz_partition_size
        return size if self.zero_stage == 3 and 1 < size < self.data_parallel_size else 0

    @property
    def built_params(self) -> int:
        """The parameters a rank builds before any split: the whole model (``unsplit_params``) with AutoTP."""
        return self.total_params if self.unsplit_params is None else self.unsplit_params

    @property
    def trainable(self) -> int:
        return self.total_params if self.trainable_params is None else self.trainable_params

    @property
    def kept_trainable(self) -> int:
        return self.kept_fp32_params if self.kept_fp32_trainable is None else self.kept_fp32_trainable

    @property
    def mixed_precision(self) -> bool:
        return self.precision in ("fp16", "bf16")

    @property
    def bf16_master_state(self) -> bool:
        """Whether a run keeps bf16 master state: both keys, bf16, ZeRO 1-3, no optimizer offload (the config layer
        refuses the keys elsewhere, so a variant outside that, e.g. the option grid's stage 0, keeps fp32 masters)."""
        return (self.bf16_master_weights_and_grads and self.bf16_optimizer_states and self.precision == "bf16"
                and self.zero_stage in (1, 2, 3) and self.offload_optimizer == "none")

    @property
    def fp16_master_state(self) -> bool:
        """Whether a run keeps fp16 host masters and gradients: the key, fp16, ZeRO 1-3, optimizer offload to cpu
        (where the config layer allows it)."""
        return (self.fp16_master_weights_and_grads and self.precision == "fp16" and self.zero_stage in (1, 2, 3)
                and self.offload_optimizer == "cpu")

    @property
    def master_element_bytes(self) -> int:
        """Bytes of one element of the optimizer's masters and their gradients: 2 with bf16 master state."""
        return 2 if self.bf16_master_state else 4

    @property
    def accumulator_element_bytes(self) -> int | None:
        """Bytes of one element of the gradient accumulator ``data_types.grad_accum_dtype`` asks for where it is not
        the stage's own (the model's dtype at stages 0-1, the masters' at 2-3), at ZeRO 1-3 on the device (the config
        layer refuses it elsewhere); None: the stage accumulates as it does natively."""
        if self.grad_accum_dtype is None or self.zero_stage == 0 or self.offload_optimizer != "none":
            return None
        model = self.precision if self.mixed_precision else "fp32"
        own = model if self.zero_stage == 1 else ("bf16" if self.bf16_master_state else "fp32")
        if self.grad_accum_dtype == own:
            return None
        return 4 if self.grad_accum_dtype == "fp32" else 2

    @property
    def state_element_bytes(self) -> int:
        """Bytes of one element of an optimizer state: 2 with bf16 master state."""
        return 2 if self.bf16_master_state else 4

    @property
    def gloo(self) -> bool:
        """Collectives go through gloo (ranks on the CPU), whose collectives allocate temporaries."""
        return self.device == "cpu"

    @property
    def overlap_comm(self) -> bool:
        return self.zero_stage == 3 if self.buffers.overlap_comm is None else bool(self.buffers.overlap_comm)

    def with_(self, **changes: object) -> "EstimateInputs":
        """A copy with some fields changed (``changes``: values of any of its fields; validated again)."""
        return replace(self, **changes)
