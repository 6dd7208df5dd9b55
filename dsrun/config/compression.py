"""``compression_training``: layer reduction, weight/activation quantization and four pruning kinds.

Each technique but layer reduction is ``{shared_parameters: {...}, different_groups: {<name>: {params,
modules, related_modules}}}``; group names are open keys chosen by the user (``wq1``, ``sp1``...).

D10: defaults follow DeepSpeed, not the documentation: ``schedule_offset`` is 1000 for activation
quantization and every pruning kind (weight quantization keeps 0), ``range_calibration`` is ``dynamic``,
and a group's ``modules`` defaults to ``["*"]`` (every module).
"""
from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field

from dsrun.utils.errors import Problem

from .base import Fraction, NonNegInt, PosInt, Section
from .misc import EigenvalueConfig, QuantizeTrainingConfig

QuantType = Literal["symmetric", "asymmetric"]


class _Group(Section):
    modules: list[str] = Field(default_factory=lambda: ["*"])
    related_modules: list[list[str]] | None = None


# --- layer reduction ----------------------------------------------------------------------------------

class LayerReductionConfig(Section):
    """``layer_reduction``: keep ``keep_number_layer`` layers, initialised from ``teacher_layer`` (one index
    per kept layer) under ``module_name_prefix``; ``other_module_name`` lists further modules to copy."""

    enabled: bool = False
    keep_number_layer: PosInt | None = None
    module_name_prefix: str | None = None
    teacher_layer: list[NonNegInt] | None = None
    other_module_name: list[str] | None = None


# --- weight quantization --------------------------------------------------------------------------------

class FP16MixedQuantize(Section):
    enabled: bool = False
    quantize_change_ratio: Fraction = 0.001


class WeightQuantShared(Section):
    """``weight_quantization.shared_parameters``. ``quantizer_kernel`` needs DeepSpeed's fp16 optimizer;
    ``quantize_weight_in_forward`` must be true when the optimizer runs in fp32."""

    enabled: bool = False
    quantizer_kernel: bool = False
    schedule_offset: NonNegInt = 0
    quantize_groups: PosInt = 1
    quantize_verbose: bool = False
    quantization_type: QuantType = "symmetric"
    quantize_weight_in_forward: bool = False
    rounding: Literal["nearest", "stochastic"] = "nearest"
    fp16_mixed_quantize: FP16MixedQuantize = Field(default_factory=FP16MixedQuantize)


class WeightQuantParams(Section):
    """Bits go from ``start_bits`` down to ``target_bits``, one bit every ``quantization_period`` steps."""

    start_bits: PosInt = 8
    target_bits: PosInt = 8
    quantization_period: NonNegInt = 1


class WeightQuantGroup(_Group):
    params: WeightQuantParams = Field(default_factory=WeightQuantParams)


class WeightQuantizationConfig(Section):
    shared_parameters: WeightQuantShared = Field(default_factory=WeightQuantShared)
    different_groups: dict[str, WeightQuantGroup] = Field(default_factory=dict)


# --- activation quantization -----------------------------------------------------------------------------

class ActivationQuantShared(Section):
    enabled: bool = False
    quantization_type: QuantType = "symmetric"
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    schedule_offset: NonNegInt = 1000


class ActivationQuantParams(Section):
    """``bits`` >= 4 (documented lower bound)."""

    bits: Annotated[int, Field(ge=4)] = 8


class ActivationQuantGroup(_Group):
    params: ActivationQuantParams = Field(default_factory=ActivationQuantParams)


class ActivationQuantizationConfig(Section):
    shared_parameters: ActivationQuantShared = Field(default_factory=ActivationQuantShared)
    different_groups: dict[str, ActivationQuantGroup] = Field(default_factory=dict)


# --- pruning ----------------------------------------------------------------------------------------------

class PruneParams(Section):
    """``dense_ratio``: the fraction of weights (rows, heads, channels) kept."""

    dense_ratio: Fraction = 0.5


class PruneGroup(_Group):
    params: PruneParams = Field(default_factory=PruneParams)


class SparsePruningShared(Section):
    """``sparse_pruning.shared_parameters``. ``snip_momentum`` needs ``schedule_offset_end``,
    ``schedule_offset_stride``, ``block_pattern`` (``NxM`` or ``N:M``) and ``dense_ratio``."""

    enabled: bool = False
    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    schedule_offset: NonNegInt = 1000
    schedule_offset_end: NonNegInt | None = None
    schedule_offset_stride: PosInt | None = None
    block_pattern: str | None = None
    dense_ratio: Fraction | None = None
    excluded_modules: list[str] = Field(default_factory=list)


class SparsePruningConfig(Section):
    shared_parameters: SparsePruningShared = Field(default_factory=SparsePruningShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)


class RowPruningShared(Section):
    enabled: bool = False
    method: Literal["l1", "topk"] = "l1"
    schedule_offset: NonNegInt = 1000


class RowPruningConfig(Section):
    """``row_pruning``: rows of back-to-back Linear layers (e.g. the FFN's ``intermediate.dense``)."""

    shared_parameters: RowPruningShared = Field(default_factory=RowPruningShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)


class HeadPruningShared(Section):
    """``head_pruning.shared_parameters``: ``method`` is ``topk`` only; ``num_heads`` is required when enabled."""

    enabled: bool = False
    method: Literal["topk"] = "topk"
    schedule_offset: NonNegInt = 1000
    num_heads: PosInt | None = None


class HeadPruningConfig(Section):
    """``head_pruning``: attention output matrices; ``related_modules`` (Q/K/V) works for BERT only."""

    shared_parameters: HeadPruningShared = Field(default_factory=HeadPruningShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)


class ChannelPruningConfig(Section):
    """``channel_pruning``: channels of back-to-back Conv2d layers."""

    shared_parameters: RowPruningShared = Field(default_factory=RowPruningShared)
    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)


class CompressionConfig(Section):
    """``compression_training``: the seven compression techniques."""

    layer_reduction: LayerReductionConfig = Field(default_factory=LayerReductionConfig)
    weight_quantization: WeightQuantizationConfig = Field(default_factory=WeightQuantizationConfig)
    activation_quantization: ActivationQuantizationConfig = Field(default_factory=ActivationQuantizationConfig)
    sparse_pruning: SparsePruningConfig = Field(default_factory=SparsePruningConfig)
    row_pruning: RowPruningConfig = Field(default_factory=RowPruningConfig)
    head_pruning: HeadPruningConfig = Field(default_factory=HeadPruningConfig)
    channel_pruning: ChannelPruningConfig = Field(default_factory=ChannelPruningConfig)


_BLOCK_PATTERN = re.compile(r"^\d+(x|:)\d+$")


def check_compression(c: CompressionConfig, prefix: str) -> list[Problem]:
    """Cross-field rules of config-keys.md §3 rules 37-40."""
    base = f"{prefix}compression_training"
    problems: list[Problem] = []
    lr = c.layer_reduction
    if lr.enabled:
        if lr.keep_number_layer is None:
            problems.append(Problem(f"{base}.layer_reduction.keep_number_layer", "required when layer_reduction is enabled"))
        if lr.teacher_layer is None and lr.other_module_name is None:
            problems.append(Problem(f"{base}.layer_reduction.teacher_layer",
                                    "required (or other_module_name) when layer_reduction is enabled"))
        if lr.teacher_layer is not None and lr.module_name_prefix is None:
            problems.append(Problem(f"{base}.layer_reduction.module_name_prefix",
                                    "required with teacher_layer (names the layers to reinitialise)"))
        if lr.teacher_layer is not None and lr.keep_number_layer is not None \
                and len(lr.teacher_layer) != lr.keep_number_layer:
            problems.append(Problem(f"{base}.layer_reduction.teacher_layer",
                                    f"has {len(lr.teacher_layer)} entries but keep_number_layer is "
                                    f"{lr.keep_number_layer}; they must match"))
    # DeepSpeed reads a technique's groups only when it is enabled; so are these checks.
    wq = c.weight_quantization
    for name, group in (wq.different_groups.items() if wq.shared_parameters.enabled else ()):
        if group.params.target_bits > group.params.start_bits:
            problems.append(Problem(
                f"{base}.weight_quantization.different_groups.{name}.params.target_bits",
                f"got {group.params.target_bits}; must be <= start_bits ({group.params.start_bits})"))
        if group.params.target_bits <= 2 and wq.shared_parameters.quantization_type == "asymmetric":
            problems.append(Problem(
                f"{base}.weight_quantization.shared_parameters.quantization_type",
                f"group {name} goes down to {group.params.target_bits} bit(s): 1- and 2-bit (binary, ternary) "
                "quantization is symmetric only", "use quantization_type: symmetric"))
    sp = c.sparse_pruning.shared_parameters
    if sp.enabled and sp.method == "snip_momentum":
        for key in ("schedule_offset_end", "schedule_offset_stride", "block_pattern", "dense_ratio"):
            if getattr(sp, key) is None:
                problems.append(Problem(f"{base}.sparse_pruning.shared_parameters.{key}",
                                        "required when method is 'snip_momentum'"))
    if sp.enabled and sp.block_pattern is not None and not _BLOCK_PATTERN.match(sp.block_pattern):
        problems.append(Problem(f"{base}.sparse_pruning.shared_parameters.block_pattern",
                                f"got {sp.block_pattern!r}; allowed: 'NxM' or 'N:M', e.g. '4x1' or '2:4'"))
    if sp.enabled and sp.schedule_offset_end is not None and sp.schedule_offset_end < sp.schedule_offset:
        problems.append(Problem(f"{base}.sparse_pruning.shared_parameters.schedule_offset_end",
                                f"got {sp.schedule_offset_end}; must be >= schedule_offset ({sp.schedule_offset})"))
    hp = c.head_pruning.shared_parameters
    if hp.enabled and hp.num_heads is None:
        problems.append(Problem(f"{base}.head_pruning.shared_parameters.num_heads",
                                "required when head_pruning is enabled"))
    techniques = {
        "weight_quantization": c.weight_quantization, "activation_quantization": c.activation_quantization,
        "sparse_pruning": c.sparse_pruning, "row_pruning": c.row_pruning, "head_pruning": c.head_pruning,
        "channel_pruning": c.channel_pruning,
    }
    for name, technique in techniques.items():
        shared = technique.shared_parameters
        for group_name, group in technique.different_groups.items() if shared.enabled else ():
            if group.related_modules is not None and name not in ("row_pruning", "head_pruning", "channel_pruning"):
                problems.append(Problem(f"{base}.{name}.different_groups.{group_name}.related_modules",
                                        "only row, head and channel pruning use related_modules",
                                        "remove it from this group"))
        snip = getattr(shared, "method", None) == "snip_momentum"
        if shared.enabled and not technique.different_groups and not snip:
            problems.append(Problem(f"{base}.{name}.different_groups",
                                    "at least one group is required when enabled",
                                    "e.g. {\"g1\": {\"params\": {...}, \"modules\": [\"*\"]}}"))
    return problems


def check_quantization_modes(c: CompressionConfig, quantize_training: QuantizeTrainingConfig,
                             eigenvalue: EigenvalueConfig, precision: str,
                             zero_stage: int, prefix: str) -> list[Problem]:
    """Rules across sections: quantizing the stored weights (MoQ, or weight quantization outside the
    forward) needs 16-bit model weights beside fp32 masters; MoQ and compression's weight quantization
    are alternatives; the eigenvalue paces MoQ and needs the full weights."""
    problems: list[Problem] = []
    wq = c.weight_quantization.shared_parameters
    if wq.enabled and not wq.quantize_weight_in_forward and precision == "fp32":
        problems.append(Problem(f"{prefix}compression_training.weight_quantization.shared_parameters."
                                "quantize_weight_in_forward", "is false, which quantizes the model's 16-bit weights "
                                "after each step and needs fp16 or bf16; with fp32 training it must be true",
                                "set quantize_weight_in_forward: true, or train in bf16/fp16"))
    if quantize_training.enabled:
        if precision == "fp32":
            problems.append(Problem(f"{prefix}quantize_training.enabled", "MoQ quantizes the model's 16-bit weights "
                                    "after each step and needs fp16 or bf16 training",
                                    "enable bf16 or fp16, or use compression_training.weight_quantization with "
                                    "quantize_weight_in_forward: true"))
        if wq.enabled:
            problems.append(Problem(f"{prefix}quantize_training.enabled", "is true together with "
                                    "compression_training.weight_quantization; both quantize the weights",
                                    "enable one of the two"))
        bits = quantize_training.quantize_bits
        if bits.target_bits > bits.start_bits:
            problems.append(Problem(f"{prefix}quantize_training.quantize_bits.target_bits",
                                    f"got {bits.target_bits}; must be <= start_bits ({bits.start_bits})"))
        if bits.target_bits <= 2 and quantize_training.quantize_algo.q_type == "asymmetric":
            problems.append(Problem(f"{prefix}quantize_training.quantize_algo.q_type", "1- and 2-bit quantization "
                                    "is symmetric only", "use q_type: symmetric"))
    if eigenvalue.enabled:
        if not quantize_training.enabled:
            problems.append(Problem(f"{prefix}eigenvalue.enabled", "the eigenvalues pace MoQ's bit schedule, and "
                                    "quantize_training is not enabled", "enable quantize_training, or disable eigenvalue"))
        if zero_stage == 3:
            problems.append(Problem(f"{prefix}eigenvalue.enabled", "Hessian eigenvalues need the full weights; "
                                    "ZeRO-3 partitions them", "use ZeRO stage 0-2 with eigenvalue"))
    return problems
