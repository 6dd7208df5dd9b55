"""1-bit LAMB (https://arxiv.org/abs/2104.06069): LAMB for ``freeze_step`` steps, then the variance and the
layer-wise scaling coefficients frozen and only the momentum communicated, compressed to 1 bit.

Everything "per parameter" below is per model parameter (layer-wise, as LAMB means it), also inside ZeRO's
flat masters and across ZeRO-1 partitions (the partial norms are all-reduced, a few floats per parameter).

* **warm-up**, ``t <= freeze_step``: LAMB on the all-reduced gradient: Adam moments, ``update = m_hat /
  (sqrt(v_hat) + eps) + weight_decay * p``, ``coeff = clamp(||p|| / ||update||, min_coeff, max_coeff)`` (1.0
  when either norm is 0), ``p -= lr * coeff * update``. Each coefficient other than exactly 1.0 enters a
  running average ``coeff_freeze = coeff_beta * coeff_freeze + (1 - coeff_beta) * coeff`` (from 0, so
  ``1 / (1 - coeff_beta) <= freeze_step`` is required). At ``t == freeze_step`` a copy of ``v`` starts
  ``v_fresh``.
* **compression**, ``t > freeze_step``: at its first step each parameter gets ``scaling_coeff = mean RMS /
  its momentum's RMS`` (so all momenta share one magnitude in the compressed vector). Each step: every rank
  forms ``(b1 m + (1 - b1) g_local) * scaling_coeff``; the compressed all-reduce's mean divided by
  ``scaling_coeff`` is the new ``m`` (``exp_avg_mask`` applied). The gradient it implies, ``(m - b1 m_last) /
  (1 - b1)``, keeps ``v_fresh`` up to date while ``v`` stays frozen. ``factor`` = the largest ratio of
  ``sqrt(v_hat) + eps`` to ``sqrt(v_fresh_hat) + eps`` over the parameter (with weight decay blended
  towards 1 by ``||m_hat / denom|| / ||update||``), clamped to ``[factor_min, factor_max]`` and to
  ``last_factor * (1 +- factor_threshold)``; ``p -= lr * coeff_freeze * factor * update``.

With ``bias_correction`` (default; DeepSpeed ignores it) ``m_hat = m / (1 - b1^t)``, the frozen
``v_hat = v / (1 - b2^freeze_step)`` and ``v_fresh_hat = v_fresh / (1 - b2^t)``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import torch

from dsrun import comm
from dsrun.config.optim import lamb_pair_problems
from dsrun.utils.errors import ConfigError

from dsrun.optim.onebit.base import (PARAMS, OneBitOptimizer, adam_denominator, bias_corrections, check_common, check_step_count,
                   require, shape_numel)
from dsrun.optim.rank_state import RangeRead


class _Segment(NamedTuple):
    index: int  # the parameter's position in the optimizer's list of all parameters
    start: int  # where its elements sit in this rank's master tensor
    length: int


class OnebitLamb(OneBitOptimizer):
    """DeepSpeed's ``deepspeed.runtime.fp16.onebit.lamb.OnebitLamb`` (module docstring)."""

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1):
        beta1, beta2 = check_common(lr, betas, eps, weight_decay, max_grad_norm, amsgrad, "OneBitLamb")
        self.freeze_step = check_step_count(freeze_step, "freeze_step")
        require(0 <= coeff_beta < 1, "coeff_beta", f"got {coeff_beta}; expected a number in [0, 1)")
        pairs = lamb_pair_problems(dict(freeze_step=self.freeze_step, coeff_beta=coeff_beta, max_coeff=max_coeff,
                                        min_coeff=min_coeff, factor_max=factor_max, factor_min=factor_min), PARAMS)
        if pairs:  # the rules dsrun config --validate runs, on the same values
            raise ConfigError(pairs)
        require(0 <= factor_threshold, "factor_threshold", f"got {factor_threshold}; expected >= 0")
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.coeff_beta, self.factor_max, self.factor_min = float(coeff_beta), float(factor_max), float(factor_min)
        self.factor_threshold = float(factor_threshold)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=(beta1, beta2), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults, deepspeed, cuda_aware, comm_backend_name)
        # per model parameter (by name once bound): lamb_coeff_freeze, last_factor, scaling_coeff
        self.coeffs: dict[str, dict[str, float]] = {}
        self.scaling_frozen = False  # the scaling coefficients are set at the first compression step
        self.lamb_coeffs: list[float] = []
        self._momentum: dict[int, Any] = {}  # stage 1: the last exchange's result per master

    def reduce_next_step(self) -> bool:
        return self.steps_taken() < self.freeze_step

    def phase_note(self) -> str:
        return (f"warm-up done after {self.freeze_step} steps: variance and LAMB coefficients frozen, only the "
                "momentum is communicated, compressed to 1 bit")

    def get_lamb_coeffs(self) -> list[float]:
        """The coefficient each parameter's update was scaled by in the last step (DeepSpeed's method)."""
        return list(self.lamb_coeffs)

    def after_load(self) -> None:
        self._momentum = {}

    # --- parameters inside the masters ------------------------------------------------------------------
    def _names(self) -> list[str]:
        if self.strategy is not None:
            return [name for layout in self.layouts for name in layout.shapes]
        return [f"{gi}.{pi}" for gi, g in enumerate(self.param_groups) for pi in range(len(g["params"]))]

    def _segments(self, gi: int, pi: int, p: torch.Tensor) -> list[_Segment]:
        names = {name: i for i, name in enumerate(self._names())}
        if self.strategy is None:
            return [_Segment(names[f"{gi}.{pi}"], 0, p.numel())]
        return [_Segment(names[s.name], s.master_offset, s.length) for s in self.layouts[gi].own]

    def _full_segments(self, gi: int) -> list[_Segment]:
        names = {name: i for i, name in enumerate(self._names())}
        return [_Segment(names[s.name], s.master_offset, s.length) for s in self.layouts[gi].full]

    def _per_param(self, tensors: list[torch.Tensor], segments: list[_Segment], op: str = "sum") -> torch.Tensor:
        """Per parameter (all of the optimizer's, columns) the sum of squares (``op="sum"``) or the maximum
        (``"max"``) of each tensor's elements (rows), over every rank's part of the parameter."""
        count = len(self._names())
        fill = 0.0 if op == "sum" else float("-inf")
        out = torch.full((len(tensors), count), fill, dtype=torch.float64, device=tensors[0].device)
        for seg in segments:
            for row, t in enumerate(tensors):
                piece = t.view(-1)[seg.start:seg.start + seg.length]
                out[row, seg.index] = piece.double().square().sum() if op == "sum" else piece.max().double()
        if self.stage == 1 and self.world_size > 1:
            comm.all_reduce(out, op=comm.ReduceOp.SUM if op == "sum" else comm.ReduceOp.MAX,
                            group=self.strategy.ctx.group)
        return out

    def _coeff_state(self, name: str) -> dict[str, float]:
        return self.coeffs.setdefault(name, {"lamb_coeff_freeze": 0.0, "last_factor": 1.0, "scaling_coeff": 1.0})

    def _scale_segments(self, tensor: torch.Tensor, segments: list[_Segment], divide: bool = False) -> torch.Tensor:
        names = self._names()
        for seg in segments:
            scale = self._coeff_state(names[seg.index])["scaling_coeff"]
            piece = tensor.view(-1)[seg.start:seg.start + seg.length]
            piece.div_(scale) if divide else piece.mul_(scale)
        return tensor

    def _apply(self, p: torch.Tensor, update: torch.Tensor, segments: list[_Segment], coeffs: dict[int, float],
               lr: float) -> None:
        for seg in segments:
            p.view(-1)[seg.start:seg.start + seg.length].add_(update.view(-1)[seg.start:seg.start + seg.length],
                                                               alpha=-lr * coeffs[seg.index])

    # --- the step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.begin_step(closure)
        self.lamb_coeffs = []
        if self.steps_taken() + 1 > self.freeze_step and not self.scaling_frozen:
            self._freeze_scaling_coeffs()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.moment_state(p)
                state["step"] += 1
                segments = self._segments(gi, pi, p)
                if state["step"] <= self.freeze_step:
                    self._warmup(p, state, group, segments)
                else:
                    self._compressed(gi, p, state, group, segments)
        return loss

    def _freeze_scaling_coeffs(self) -> None:
        """At the first compression step: each parameter's momentum scaled to the mean RMS of all of them."""
        names = self._names()
        sums = None
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if "exp_avg" not in self.state.get(p, {}):
                    continue
                segments = self._segments(gi, pi, p)
                part = self._per_param([self.state[p]["exp_avg"]], segments)[0]
                sums = part if sums is None else torch.maximum(sums, part)  # each parameter in one master only
        if self.strategy is not None:
            numels = [shape_numel(shape) for layout in self.layouts for shape in layout.shapes.values()]
        else:
            numels = [p.numel() for g in self.param_groups for p in g["params"]]
        if sums is None:
            return
        rms = [(float(sums[i]) / max(numels[i], 1)) ** 0.5 for i in range(len(names))]
        united = sum(rms) / max(len(rms), 1)
        for i, name in enumerate(names):
            self._coeff_state(name)["scaling_coeff"] = united / rms[i] if rms[i] > 0 else 1.0
        self.scaling_frozen = True

    def _warmup(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], segments: list[_Segment]) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"] = exp_avg_sq.clone()
        bias1, bias2 = bias_corrections(group["bias_correction"], beta1, beta2, state["step"], state["step"])
        update = (exp_avg / bias1).div_(adam_denominator(exp_avg_sq, bias2, group["eps"], self.eps_inside_sqrt))
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        norms = self._per_param([p, update], segments).sqrt()
        names, coeffs = self._names(), {}
        for seg in segments:
            weight_norm, update_norm = float(norms[0, seg.index]), float(norms[1, seg.index])
            coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
            if seg.index not in coeffs and coeff != 1.0:
                frozen = self._coeff_state(names[seg.index])
                frozen["lamb_coeff_freeze"] = self.coeff_beta * frozen["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
            coeffs[seg.index] = coeff
        self.lamb_coeffs.extend(coeffs.values())
        self._apply(p, update, segments, coeffs, group["lr"])

    def _compressed(self, gi: int, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                    segments: list[_Segment]) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        fresh = state.setdefault("exp_avg_sq_fresh", exp_avg_sq.clone())
        last = exp_avg.clone()
        self._exchange_momentum(gi, p, exp_avg, beta1, segments)
        grad = (exp_avg - last * beta1).div_(1 - beta1)  # the gradient the new momentum implies
        fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = bias_corrections(group["bias_correction"], beta1, beta2, state["step"], self.freeze_step)
        _, bias2_fresh = bias_corrections(group["bias_correction"], beta1, beta2, state["step"], state["step"])
        denom = adam_denominator(exp_avg_sq, bias2, group["eps"], self.eps_inside_sqrt)
        prelim = (exp_avg / bias1).div_(denom)
        update = prelim.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else prelim
        ratio = denom.div_(adam_denominator(fresh, bias2_fresh, group["eps"], self.eps_inside_sqrt))
        largest = self._per_param([ratio], segments, op="max")[0]
        norms = self._per_param([prelim, update], segments).sqrt() if group["weight_decay"] else None
        names, coeffs = self._names(), {}
        for seg in segments:
            if seg.index in coeffs:
                continue
            frozen = self._coeff_state(names[seg.index])
            factor = float(largest[seg.index])
            if norms is not None and float(norms[1, seg.index]) > 0:
                update_ratio = min(1.0, float(norms[0, seg.index]) / float(norms[1, seg.index]))
                factor = factor * update_ratio + (1.0 - update_ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            factor = min(max(factor, frozen["last_factor"] * (1.0 - self.factor_threshold)),
                         frozen["last_factor"] * (1.0 + self.factor_threshold))
            frozen["last_factor"] = factor
            coeffs[seg.index] = frozen["lamb_coeff_freeze"] * factor
        self.lamb_coeffs.extend(coeffs.values())
        self._apply(p, update, segments, coeffs, group["lr"])

    def _exchange_momentum(self, gi: int, p: torch.Tensor, exp_avg: torch.Tensor, beta1: float,
                           segments: list[_Segment]) -> None:
        """``exp_avg`` = the compressed mean over ranks of the scaled ``b1 exp_avg + (1 - b1) g_local``,
        unscaled and masked."""
        if self.world_size == 1:
            exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            self.mask(gi, exp_avg)
            return
        if self.stage == 0:
            worker_input = self._scale_segments(exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1), segments)
        else:
            full_segments = self._full_segments(gi)
            previous = self._momentum.get(gi)
            if previous is None:
                full = self.gather_full(gi, exp_avg)
            else:
                full = self.mask_full(gi, self._scale_segments(previous.decode(), full_segments, divide=True))
            full.mul_(beta1).add_(self.full_local_gradient(gi, p)[:full.numel()], alpha=1 - beta1)
            worker_input = self._scale_segments(full, full_segments)
        result = self.exchange(gi, worker_input)
        exp_avg.copy_(self.own_part(gi, result))
        self._scale_segments(exp_avg, segments, divide=True)
        self.mask(gi, exp_avg)
        if self.stage == 1:
            self._momentum[gi] = result

    # --- rank state: the per-parameter coefficients travel with it (by name, any layout) --------------------
    def rank_state_dict(self) -> dict[str, Any]:
        out = super().rank_state_dict()
        out["lamb"] = {name: dict(values) for name, values in self.coeffs.items()}
        out["lamb_scaling_frozen"] = self.scaling_frozen
        return out

    def load_rank_extras(self, states: list[dict[str, Any]], exact: bool, read: RangeRead) -> None:
        """The coefficients are the same on every rank: the first saved rank's (none saved: they restart, as
        DeepSpeed restarts them on every load)."""
        self.coeffs = {name: dict(values) for name, values in (states[0].get("lamb", {}) if states else {}).items()}
        self.scaling_frozen = bool(states[0].get("lamb_scaling_frozen", False)) if states else False

