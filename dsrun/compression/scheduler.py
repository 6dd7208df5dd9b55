"""The compression scheduler: which technique is on at which step, and how far along it is.

Steps are optimizer steps: the engine calls :meth:`compression_scheduler.step` once after every applied
(not overflowed) optimizer step, and once with ``step_zero_check=True`` before the first, so at step ``s``
(``s`` steps done) the forward sees:

* weight quantization: off before ``schedule_offset``; then ``start_bits``, one bit fewer every
  ``quantization_period`` steps, down to ``target_bits`` (:func:`weight_bits_at`). With
  ``fp16_mixed_quantize`` the forward uses ``r·Q(w) + (1 - r)·w`` where the quantized share ``r`` starts
  at ``quantize_change_ratio`` when a bit width begins and grows by it every step, up to 1;
* activation quantization: on from ``schedule_offset``;
* sparse pruning: ``l1`` masks computed at ``schedule_offset`` from the weights' magnitudes (and, with
  ``schedule_offset_end``, recomputed every ``schedule_offset_stride`` steps until then); ``topk`` masks
  follow the learned scores from ``schedule_offset`` (frozen at ``schedule_offset_end`` when given);
  ``snip_momentum`` prunes to :func:`dsrun.compression.pruning.snip_density` every stride;
* row, head and channel pruning: on from ``schedule_offset`` (``l1`` masks computed then, ``topk`` learned).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from dsrun import comm

from . import layers
from .compress import TECHNIQUES, _KIND, plan_of, read_config
from .pruning import snip_density

if TYPE_CHECKING:
    from dsrun.config import ConfigSource, DSConfig
    from dsrun.config.compression import CompressionConfig, WeightQuantShared

log = logging.getLogger("dsrun.compression")
_TECHNIQUE_OF_KIND = {kind: technique for technique, kind in _KIND.items()}


def weight_bits_at(step: int, offset: int, start: int, target: int, period: int) -> int | None:
    """Bits of a weight quantization group after ``step`` optimizer steps (None: not quantized yet)."""
    if step < offset:
        return None
    if period <= 0:
        return target
    return max(target, start - (step - offset) // period)


def bits_started_at(step: int, offset: int, start: int, target: int, period: int) -> int:
    """The step at which the current bit width (:func:`weight_bits_at`) began."""
    bits = weight_bits_at(step, offset, start, target, period)
    return offset if bits is None or period <= 0 else offset + (start - bits) * period


def mixed_share(step: int, started: int, change_ratio: float) -> float:
    """``fp16_mixed_quantize``: the quantized value's share ``step - started + 1`` steps into a bit width."""
    return min(1.0, change_ratio * (step - started + 1))


def _say(message: str) -> None:
    log.info(message)
    if not comm.is_initialized() or comm.get_rank() == 0:
        print(f"[dsrun] compression: {message}", flush=True)


def _gathered(param: torch.Tensor) -> Any:
    from dsrun.zero import GatheredParameters

    return GatheredParameters([param] if isinstance(param, nn.Parameter) else [])


class compression_scheduler:  # noqa: N801 (DeepSpeed's name)
    """Steps the techniques of a model prepared by :func:`dsrun.compression.compress.init_compression`."""

    def __init__(self, model: nn.Module,
                 compression_config: ConfigSource | DSConfig | CompressionConfig | None = None):
        self.model = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
        plan = plan_of(self.model)
        if plan is None:
            from dsrun.utils.errors import Problem, UserError

            raise UserError(Problem("compression_scheduler", "the model was not prepared by init_compression",
                                    "call init_compression(model, config) first"))
        self.config = plan.config if compression_config is None else read_config(compression_config)
        self.training_steps = 0
        self.weight_quantization_enabled = False
        self.announced: set[str] = set()
        self.modules = [(n, m) for n, m in plan.modules(self.model).items() if m.ds_compression.weight_owner is None]
        self.activation_modules = [(n, m) for n, m in plan.modules(self.model).items()
                                   if m.ds_compression.activation is not None]

    # --- DeepSpeed's calls ------------------------------------------------------------------------------
    def step(self, step_zero_check: bool = False) -> None:
        """Count one optimizer step (``step_zero_check``: none, just apply step 0) and apply the schedule."""
        if not step_zero_check:
            self.training_steps += 1
        self.check_all_modules()

    def check_all_modules(self) -> None:
        s = self.training_steps
        wq = self.config.weight_quantization.shared_parameters
        active: set[str] = set()
        for name, module in self.modules:
            c = module.ds_compression
            if c.weight is not None:
                self._weight_bits(name, c.weight, s, wq)
                if c.weight.bits is not None:
                    active.add("weight_quantization")
            for p in c.prunings.values():
                self._pruning(module, p, s)
                if p.active:
                    active.add(_TECHNIQUE_OF_KIND[p.kind])
        aq_offset = self.config.activation_quantization.shared_parameters.schedule_offset
        for _, module in self.activation_modules:
            module.ds_compression.activation.active = s >= aq_offset
            if s >= aq_offset:
                active.add("activation_quantization")
        self.weight_quantization_enabled = "weight_quantization" in active
        for technique in sorted(active - self.announced):
            _say(f"{technique} active from step {s}")
        self.announced |= active

    def state_dict(self) -> dict[str, Any]:
        return {"training_steps": self.training_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the step count from ``state``; the masks are the ones the checkpoint's module state holds,
        so they are marked computed instead of being computed again."""
        self.training_steps = int(state.get("training_steps", 0))
        s = self.training_steps
        for _, module in self.modules:
            for p in module.ds_compression.prunings.values():
                shared = self._shared(p)
                p.active = s >= shared.schedule_offset
                end = getattr(shared, "schedule_offset_end", None)
                if p.method == "snip_momentum":
                    p.density = snip_density(s, shared.schedule_offset, end or 0, shared.schedule_offset_stride or 1,
                                             p.dense_ratio)
                    p.ready = p.density < 1.0
                elif p.method == "topk":
                    p.frozen = p.ready = end is not None and s >= end
                else:
                    p.ready = p.active
        self.announced = set(TECHNIQUES)  # already announced by the run that saved it
        self.check_all_modules()

    # --- the techniques -----------------------------------------------------------------------------------
    def _shared(self, p: layers.Pruning) -> Any:
        return getattr(self.config, _TECHNIQUE_OF_KIND[p.kind]).shared_parameters

    def _weight_bits(self, name: str, w: layers.WeightQuantization, s: int, shared: WeightQuantShared) -> None:
        offset = shared.schedule_offset
        bits = weight_bits_at(s, offset, w.start_bits, w.target_bits, w.period)
        if bits != w.bits and bits is not None and shared.quantize_verbose:
            _say(f"{name}: {bits}-bit weights from step {s} (group {w.group})")
        w.bits = bits
        if w.change_ratio is not None and bits is not None:
            w.mixed_share = mixed_share(s, bits_started_at(s, offset, w.start_bits, w.target_bits, w.period),
                                        w.change_ratio)

    def _pruning(self, module: nn.Module, p: layers.Pruning, s: int) -> None:
        shared = self._shared(p)
        offset = shared.schedule_offset
        p.active = s >= offset
        if not p.active:
            return
        end = getattr(shared, "schedule_offset_end", None)
        stride = getattr(shared, "schedule_offset_stride", None) or 1
        if p.method == "l1":
            recompute = end is not None and s <= end and (s - offset) % stride == 0
            if not p.ready or recompute:
                self._store_mask(module, p, layers.magnitude_mask)
        elif p.method == "topk":
            if end is not None and s >= end and not p.frozen:
                from .pruning import topk_mask

                scores = getattr(module, p.scores_name)
                with _gathered(scores), torch.no_grad():
                    getattr(module, p.mask_name).copy_(topk_mask(scores.detach().float(), p.dense_ratio) > 0)
                p.frozen = p.ready = True
        else:
            density = snip_density(s, offset, end or 0, stride, p.dense_ratio)
            if density < 1.0 and density != p.density:
                scores = getattr(module, f"{p.kind}_snip_scores")
                if comm.is_initialized() and comm.get_world_size() > 1:
                    comm.all_reduce(scores)  # every rank ranks the same (averaged) scores
                    scores.div_(comm.get_world_size())
                self._store_mask(module, p, lambda w, q: layers.magnitude_mask(
                    w, q, scores=scores if bool(scores.any()) else None, density=density))
                p.density = density

    @staticmethod
    def _store_mask(module: nn.Module, p: layers.Pruning,
                    compute: Callable[[torch.Tensor, layers.Pruning], torch.Tensor]) -> None:
        with _gathered(module.weight), torch.no_grad():
            getattr(module, p.mask_name).copy_(compute(module.weight, p))
        p.ready = True
