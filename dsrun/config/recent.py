"""Sections DeepSpeed added after 0.14 (its 0.19 models are the reference): ``torch_autocast``, ZeRO's
``zenflow`` and ``leaf_module``, ``tensor_parallel`` (AutoTP training) and the checkpoint ``writer``.

Defaults are DeepSpeed 0.19's. Which of these keys act in dsrun and which are refused when a config
enables them is the support ledger's business (:mod:`dsrun.config.ledger.recent`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from dsrun.utils.errors import Problem

from .base import DTypeName, Fraction, NonNegInt, OpenDict, PosInt, RawValue, Section, TorchDTypeName


class TorchAutocastConfig(Section):
    """``torch_autocast``: run the forward under ``torch.autocast`` (the model keeps fp32 parameters).

    ``dtype`` None is the device's autocast default (bfloat16 on CPU); DeepSpeed's spellings are accepted
    (``"torch.bfloat16"``, ``"bfloat16"``, ``"bf16"``...); ``lower_precision_safe_modules``
    (``"package.Class"`` names) are the modules whose parameters' gradients are reduced in ``dtype``
    (None: DeepSpeed's list, ``torch.nn.Linear`` and ``Conv1d/2d/3d``).
    """

    enabled: bool = False
    dtype: TorchDTypeName | None = None
    lower_precision_safe_modules: list[str] | None = None


class ZenFlowConfig(Section):
    """``zero_optimization.zenflow``: ZenFlow's stall-free offloaded optimizer at stages 1-2 with
    ``offload_optimizer.device: cpu`` (:mod:`dsrun.zero.zenflow`, docs/zenflow.md): each step the
    ``topk_ratio`` most important gradient columns are updated at once, the rest accumulate and are applied by
    the CPU optimizer every ``update_interval`` steps ("auto": when they have caught up), in the background
    during the next forward/backward with ``overlap_step``. Columns are re-selected every ``select_interval``
    steps (``select_strategy: "step"``) or epochs (``"epoch"``, ``steps_per_epoch`` steps each, else the
    training data loader's length; ``"auto"`` is every epoch). ``full_warm_up_rounds`` steps of plain
    offload come first; ``pt_reserved_cores_perc`` of the cores stay with training, the overlapped CPU step
    runs on the rest; ``offload`` keeps the selected columns' optimizer state in host memory (where a CPU run
    keeps it anyway; the estimator counts it there)."""

    topk_ratio: Fraction = 0.1
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    select_interval: Literal["auto"] | PosInt = "auto"
    update_interval: Literal["auto"] | PosInt = "auto"
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: Fraction = 0.99
    full_warm_up_rounds: NonNegInt = 0
    pt_reserved_cores_perc: Fraction = 0.5
    steps_per_epoch: PosInt | None = None

    def problems(self, prefix: str, stage: int, offload_device: str) -> list[Problem]:
        """What DeepSpeed refuses, and where dsrun has no ZenFlow (stage 0 or 3, no CPU offload)."""
        out = []
        if stage not in (1, 2) or offload_device != "cpu":
            out.append(Problem(prefix, f"ZenFlow runs at ZeRO stages 1-2 with offload_optimizer.device cpu (stage "
                               f"{stage}, device {offload_device})", "set stage 1 or 2 and offload the optimizer "
                               "to cpu, or remove zero_optimization.zenflow"))
        if self.select_strategy == "auto" and self.select_interval != "auto":
            out.append(Problem(f"{prefix}.select_interval", "select_strategy \"auto\" re-selects every epoch and "
                               "would override it", "leave select_interval \"auto\" or pick \"step\"/\"epoch\""))
        if self.select_strategy == "step" and self.select_interval == "auto":
            out.append(Problem(f"{prefix}.select_interval", "select_strategy \"step\" needs a number of steps",
                               "e.g. 8"))
        if self.select_strategy == "step" and isinstance(self.select_interval, int) \
                and isinstance(self.update_interval, int) and self.select_interval < self.update_interval:
            out.append(Problem(f"{prefix}.select_interval", f"got {self.select_interval}, below update_interval "
                               f"{self.update_interval}", "select at most as often as the CPU updates"))
        return out


# DeepSpeed 0.19's default leaf classes: Hugging Face's MoE blocks, whose experts run data-dependently
DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


def _names_once(value: object) -> object:
    """One name may be written as a string; each name counts once, first place kept (as DeepSpeed reads them)."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (list, tuple)):
        return list(dict.fromkeys(str(v) for v in value))
    return value


NameList = Annotated[list[str], BeforeValidator(_names_once)]


class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: modules ZeRO-3 gathers as a whole (not hooked per submodule);
    DeepSpeed's ``set_z3_leaf_modules`` from the config. ``classes`` defaults to DeepSpeed's list,
    :data:`DEFAULT_LEAF_MODULE_CLASSES` (a class not in the model matches nothing); a string is a list of one."""

    classes: NameList = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: NameList = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: NameList = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))


class TPConfig(Section):
    tp_size: PosInt = 1
    tp_grain_size: PosInt = 1
    mpu: Any = None
    tp_group: Any = None


class TensorParallelConfig(Section):
    """``tensor_parallel``: DeepSpeed's AutoTP for training (``autotp_size`` > 1 shards linear layers)."""

    dtype: DTypeName = "fp16"
    autotp_size: NonNegInt = 0
    tp_overlap_comm: bool = False
    vocab_parallel_lm_head: bool | None = None
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    tp: TPConfig = Field(default_factory=TPConfig)
    injection_policy_tuple: list[Any] | None = None
    partition_config: OpenDict | None = None
    preset_model: str | None = None
    keep_module_on_host: bool = False
    kernel_inject: bool = False


def _upper(value: RawValue) -> RawValue:
    return value.upper() if isinstance(value, str) else value


class CheckpointWriterConfig(Section):
    """``checkpoint.writer``: DeepSpeed's checkpoint writers (FastPersist). Present, every checkpoint file is
    written through ``type``'s writer (:func:`dsrun.io.open_writer`): ``FAST`` O_DIRECT writes of
    ``io_buffer_size``-byte buffers through the async I/O op (the ``aio`` section), double-buffered with
    ``io_buffer_double``; ``PYTHON`` a buffered file; ``MOCK`` counts bytes and writes empty files.
    ``show_statistics`` logs each file's write statistics.
    ``decoupled`` writes and publishes the save in the background (:mod:`dsrun.checkpoint.decoupled`), through
    the same writer. ``data_parallel`` and ``io_multiplier`` are refused (the support ledger)."""

    type: Annotated[Literal["MOCK", "PYTHON", "FAST"], BeforeValidator(_upper)] = "FAST"
    io_buffer_size: NonNegInt = 64 * 1024 ** 2
    io_buffer_double: bool = True
    show_statistics: bool = False
    data_parallel: Annotated[Literal["REPLICA", "SOCKET", "MACHINE"] | None, BeforeValidator(_upper)] = None
    decoupled: bool = False
    io_multiplier: PosInt = 1

    def problems(self, prefix: str, aio_threads: int) -> list[Problem]:
        """The fast writer's O_DIRECT writes are whole multiples of 4096 bytes per aio thread, and the double
        buffer splits ``io_buffer_size`` in two: it must be a positive multiple of that."""
        if self.type != "FAST":
            return []
        multiple = 4096 * max(1, aio_threads) * (2 if self.io_buffer_double else 1)
        if self.io_buffer_size > 0 and self.io_buffer_size % multiple == 0:
            return []
        why = f"4096 bytes x aio.thread_count {aio_threads}" + (" x 2 halves (io_buffer_double)"
                                                                  if self.io_buffer_double else "")
        size = max(multiple, self.io_buffer_size // multiple * multiple)
        return [Problem(f"{prefix}.io_buffer_size", f"got {self.io_buffer_size}; the fast writer needs a positive "
                        f"multiple of {multiple} ({why})", f"use {size}")]
