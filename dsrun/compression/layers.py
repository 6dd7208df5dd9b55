"""Compressed Linear, Conv2d and Embedding layers: one forward that applies whatever is active.

:func:`make_compressed` turns a module into its compressed class in place (``module.__class__`` becomes a
subclass of its own class), so its parameters keep their names and identities: the optimizer, ZeRO's
partitioning and a checkpoint see the same tensors as before. Per-module settings live in
``module.ds_compression`` (a :class:`ModuleCompression`); masks are buffers and learnable scores are
parameters registered on the module, so checkpoints carry them.

The forward computes, in this order: activation quantization of the input (Linear, Conv2d), the pruning
masks on the weight (and on the bias for rows and channels), then weight fake-quantization with a
straight-through gradient. A subclass of Linear/Conv2d/Embedding runs its base class's forward once
compressed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from . import pruning
from .quantizers import QuantSpec, dynamic_range, fake_quantize_activation, fake_quantize_ste

COMPRESSIBLE = (nn.Linear, nn.Conv2d, nn.Embedding)
STATIC_RANGE_MOMENTUM = 0.95  # running min/max of static activation ranges


@dataclass
class WeightQuantization:
    """One module's weight quantization: bits follow the group's schedule (``bits`` None while off)."""

    group: str
    start_bits: int
    target_bits: int
    period: int
    groups: int
    symmetric: bool
    stochastic: bool
    in_forward: bool
    change_ratio: float | None = None  # fp16_mixed_quantize: the quantized share grows by this per step
    bits: int | None = None
    mixed_share: float = 1.0

    def spec(self, bits: int | None = None) -> QuantSpec:
        return QuantSpec(bits or self.bits or self.target_bits, self.symmetric, self.groups, self.stochastic)


@dataclass
class ActivationQuantization:
    bits: int
    symmetric: bool
    dynamic: bool
    active: bool = False


@dataclass
class Pruning:
    """One pruning technique on one module. ``kind`` is sparse, row, head or channel."""

    kind: str
    method: str
    dense_ratio: float
    pattern: tuple[int, str, int] | None = None
    num_heads: int | None = None
    related: list[str] = field(default_factory=list)
    active: bool = False
    ready: bool = False  # the stored mask holds the mask (l1, snip_momentum, or a frozen topk)
    frozen: bool = False  # topk past schedule_offset_end: the mask no longer follows the scores
    density: float = 1.0  # snip_momentum: the density of the current mask

    @property
    def uses_scores(self) -> bool:
        return self.method == "topk" and not self.frozen

    @property
    def applies(self) -> bool:
        return self.active and (self.uses_scores or self.ready)

    @property
    def mask_name(self) -> str:
        return f"{self.kind}_pruning_mask"

    @property
    def scores_name(self) -> str:
        return f"{self.kind}_mask_scores"


@dataclass
class ModuleCompression:
    """What is compressed in one module, and how."""

    name: str
    weight: WeightQuantization | None = None
    activation: ActivationQuantization | None = None
    prunings: dict[str, Pruning] = field(default_factory=dict)
    weight_owner: nn.Module | None = None  # a tied weight is compressed by the module that owns it

    def unit_mask(self, module: nn.Module, p: Pruning) -> torch.Tensor:
        """The 0/1 mask over ``p``'s units (weights, rows, heads or channels), learnable or stored."""
        if p.uses_scores:
            scores = getattr(module, p.scores_name)
            return pruning.learned_mask(scores, p.dense_ratio)
        return getattr(module, p.mask_name).to(module.weight.dtype)

    def weight_multiplier(self, module: nn.Module, p: Pruning, mask: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if p.kind == "sparse":
            return mask.reshape(weight.shape)
        if p.kind in ("row", "channel"):
            return mask.reshape((-1,) + (1,) * (weight.dim() - 1))
        width = weight.shape[1] // p.num_heads  # head: columns of the attention output matrix
        return mask.repeat_interleave(width).reshape(1, -1)

    def effective(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the forward computes with."""
        bias = getattr(module, "bias", None)
        if self.weight_owner is not None:
            owner = self.weight_owner
            return owner.ds_compression.effective(owner)[0], bias
        weight = module.weight
        for p in self.prunings.values():
            if p.method == "snip_momentum" and p.active:
                weight = snip_tap(module, weight, p)
            if not p.applies:
                continue
            mask = self.unit_mask(module, p)
            weight = weight * self.weight_multiplier(module, p, mask)
            if bias is not None and p.kind in ("row", "channel"):
                bias = bias * mask
        wq = self.weight
        if wq is not None and wq.in_forward and wq.bits is not None:
            quantized = fake_quantize_ste(weight, wq.spec())
            weight = quantized if wq.mixed_share >= 1.0 else (
                wq.mixed_share * quantized + (1.0 - wq.mixed_share) * weight)
        return weight, bias

    def quantize_input(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        aq = self.activation
        if aq is None or not aq.active or not x.is_floating_point():
            return x
        per_sample = 1 if isinstance(module, nn.Conv2d) else x.dim() - 1
        low, high = dynamic_range(x, per_sample)
        if not aq.dynamic:
            low, high = _static_range(module, low, high)
        return fake_quantize_activation(x, low, high, aq.bits, aq.symmetric)


def _static_range(module: nn.Module, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One range for all inputs: a running (momentum) min/max in training, fixed in eval."""
    stored = module.activation_range
    if module.training:
        batch = torch.stack([low.min(), high.max()]).to(stored.dtype)
        with torch.no_grad():
            if stored[0] > stored[1]:  # never calibrated
                stored.copy_(batch)
            else:
                stored.mul_(STATIC_RANGE_MOMENTUM).add_(batch * (1 - STATIC_RANGE_MOMENTUM))
    if stored[0] > stored[1]:  # eval before any training forward: this batch's range
        return low.min(), high.max()
    return stored[0], stored[1]


class CompressedMixin:
    """The forward of a compressed module (mixed in ahead of its own class)."""

    ds_compression: ModuleCompression

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's argument name)
        c = self.ds_compression
        input = c.quantize_input(self, input)
        weight, bias = c.effective(self)
        if isinstance(self, nn.Embedding):
            return F.embedding(input, weight, self.padding_idx, self.max_norm, self.norm_type,
                               self.scale_grad_by_freq, self.sparse)
        if isinstance(self, nn.Conv2d):
            return self._conv_forward(input, weight, bias)
        return F.linear(input, weight, bias)

    def extra_repr(self) -> str:
        c = self.ds_compression
        parts = [super().extra_repr()]  # type: ignore[misc]
        if c.weight is not None:
            parts.append(f"weight_bits={c.weight.bits}")
        if c.activation is not None:
            parts.append(f"activation_bits={c.activation.bits if c.activation.active else None}")
        parts += [f"{p.kind}_pruning={p.method}:{p.dense_ratio}" for p in c.prunings.values()]
        return ", ".join(parts)


class CompressedLinear(CompressedMixin, nn.Linear):
    pass


class CompressedConv2d(CompressedMixin, nn.Conv2d):
    pass


class CompressedEmbedding(CompressedMixin, nn.Embedding):
    pass


_CLASSES: dict[type, type] = {nn.Linear: CompressedLinear, nn.Conv2d: CompressedConv2d,
                              nn.Embedding: CompressedEmbedding}


def is_compressed(module: nn.Module) -> bool:
    return isinstance(module, CompressedMixin)


def make_compressed(module: nn.Module, name: str) -> ModuleCompression:
    """Give ``module`` (a Linear, Conv2d or Embedding) the compressed forward; returns its settings."""
    if is_compressed(module):
        return module.ds_compression
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Compressed{cls.__name__}", (CompressedMixin, cls), {"__module__": cls.__module__})
    module.ds_compression = ModuleCompression(name)
    module.__dict__["_ds_original_class"] = cls
    module.__class__ = _CLASSES[cls]
    return module.ds_compression


def restore_class(module: nn.Module) -> None:
    """Back to the module's own class (after :func:`dsrun.compression.redundancy_clean`)."""
    original = module.__dict__.pop("_ds_original_class", None)
    if original is not None:
        module.__class__ = original
        module.__dict__.pop("ds_compression", None)


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's full shape, also when ZeRO-3 has partitioned it."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def register_pruning(module: nn.Module, p: Pruning) -> None:
    """Register ``p``'s mask buffer (all kept) and, for ``topk``, its learnable scores (set later from the
    weight by :func:`init_scores`)."""
    shape = full_shape(module.weight)
    units = {"sparse": shape, "row": shape[:1], "channel": shape[:1], "head": torch.Size([p.num_heads or 1])}[p.kind]
    device = module.weight.device if module.weight.device.type != "meta" else torch.device("cpu")
    module.register_buffer(p.mask_name, torch.ones(units, dtype=torch.bool, device=device))
    if p.method == "topk":
        dtype = module.weight.dtype if module.weight.is_floating_point() else torch.float32
        module.register_parameter(p.scores_name, nn.Parameter(torch.zeros(units, dtype=dtype, device=device)))
    if p.method == "snip_momentum":
        module.register_buffer(f"{p.kind}_snip_scores", torch.zeros(units, dtype=torch.float32, device=device))
    module.ds_compression.prunings[p.kind] = p


def unit_scores(weight: torch.Tensor, p: Pruning) -> torch.Tensor:
    """Magnitude scores of ``p``'s units: ``|w|``, row/channel L1 norms, or head column-block norms."""
    if p.kind == "sparse":
        return weight.detach().float().abs()
    if p.kind in ("row", "channel"):
        return pruning.row_scores(weight)
    return pruning.head_scores(weight, p.num_heads)


def magnitude_mask(weight: torch.Tensor, p: Pruning, scores: torch.Tensor | None = None,
                   density: float | None = None) -> torch.Tensor:
    """The l1 (or snip) mask of ``p`` on ``weight``: exact density, block pattern for sparse pruning."""
    scores = unit_scores(weight, p) if scores is None else scores
    ratio = p.dense_ratio if density is None else density
    if p.kind == "sparse" and p.pattern is not None:
        return pruning.block_mask(pruning.as_matrix(scores), p.pattern, ratio).reshape(weight.shape) > 0
    return pruning.topk_mask(scores, ratio) > 0


def register_activation_range(module: nn.Module) -> None:
    device = module.weight.device if module.weight.device.type != "meta" else torch.device("cpu")
    module.register_buffer("activation_range", torch.tensor([float("inf"), float("-inf")], device=device))


class _SnipTap(torch.autograd.Function):
    """Identity on the weight whose backward adds ``|w · dL/dw|`` into a running average (snip_momentum)."""

    @staticmethod
    def forward(ctx: FunctionCtx, weight: torch.Tensor, scores: torch.Tensor, momentum: float) -> torch.Tensor:
        ctx.scores, ctx.momentum = scores, momentum
        ctx.value = weight.detach()
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        with torch.no_grad():
            ctx.scores.mul_(ctx.momentum).add_((ctx.value.float() * grad.float()).abs() * (1 - ctx.momentum))
        return grad, None, None


SNIP_MOMENTUM = 0.9


def snip_tap(module: nn.Module, weight: torch.Tensor, p: Pruning) -> torch.Tensor:
    if module.training and torch.is_grad_enabled() and weight.requires_grad:
        return _SnipTap.apply(weight, getattr(module, f"{p.kind}_snip_scores"), SNIP_MOMENTUM)
    return weight


def attach_batchnorm_mask(bn: nn.Module, conv: nn.Module, p: Pruning) -> None:
    """Zero the BatchNorm outputs of the channels ``conv``'s channel pruning removes, so the masked model
    computes what the cleaned one (without those channels) will: a BatchNorm would otherwise turn a zero
    channel into its constant ``beta - gamma·mean/std``."""
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        if not p.applies:
            return output
        mask = conv.ds_compression.unit_mask(conv, p)
        return output * mask.to(output.dtype).reshape(1, -1, *([1] * (output.dim() - 2)))
    bn.__dict__.setdefault("_ds_follower_hooks", []).append(bn.register_forward_hook(hook))
