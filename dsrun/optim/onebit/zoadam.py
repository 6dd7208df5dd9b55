"""0/1 Adam (https://arxiv.org/abs/2202.06009): 1-bit gradients between variance updates that grow apart,
then local steps with 1-bit synchronisation of the accumulated updates at intervals that grow too.

Step t (from 1), with ``var_interval`` starting at 1 and ``local_step_interval`` at 1:

* **t <= var_freeze_step** (variance still learned):

  - when ``t % var_interval == 0`` the gradient was all-reduced in backward: ``m`` and ``v`` take it as in
    Adam, and every ``var_update_scaler`` such updates ``var_interval`` doubles (the exponential rule,
    kappa in the paper);
  - otherwise backward reduced nothing: each rank's gradient goes through the compressed all-reduce (error
    feedback on both sides) and only ``m`` takes the 1-bit mean (``exp_avg_mask`` applied);
  - then the Adam update.

* **t > var_freeze_step** (``v`` frozen, no backward reduction at all): each rank steps on its own gradient,
  ``m = b1 m + (1 - b1) g_local`` (masked) and the Adam update, while ``lrs`` adds up the learning rates. Every
  ``local_step_interval`` steps the ranks synchronise: the displacement since the last synchronisation,
  multiplied by ``sqrt(v_hat) + eps``, is averaged by the compressed all-reduce (error buffers zeroed when
  this phase starts), ``m`` becomes minus that mean over ``lrs``, and the parameters become the
  synchronised point plus the mean displacement. Every ``local_step_scaler`` steps of this phase the interval
  doubles, up to ``local_step_clipper``. Weight decay is kept out of the displacement: it is measured from
  the synchronised point decayed by the product of ``(1 - lr * weight_decay)`` over the interval
  (``state["decay"]``), so ``m`` holds momentum only.

DeepSpeed measures the displacement from the undecayed point, so the decay enters ``m`` at every
synchronisation and ``m`` carries it into the following steps: at interval 1 the decay acts about
``1 / (1 - beta1)`` times (10 times at beta1 = 0.9) as strongly as ``weight_decay`` says, and 0/1 Adam with
``var_update_scaler >= var_freeze_step`` and interval 1, which is 1-bit Adam's algorithm, does not reduce to
it (measured on gpt_onebit, docs/onebit.md). With ``weight_decay = 0`` both are the same arithmetic.

DeepSpeed accumulates the local updates in a separate buffer and undoes them with a subtraction, which leaves
every rank a different rounding; dsrun keeps the synchronised parameters (``state["synced_param"]``, the
same memory) and restarts from them, so all ranks hold bitwise the same weights after each synchronisation.
Between synchronisations each rank's weights and momentum are its own: they are part of the rank state a
checkpoint keeps. Bias correction (default on, which DeepSpeed ignores) uses t for ``m`` and the number of
variance updates for ``v``; with it ``m`` is stored uncorrected. ZeRO stage 0 only: the local steps update
every rank's whole model, which ZeRO-1's partitioned optimizer state cannot do.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from dsrun.optim.onebit.base import OneBitOptimizer, adam_denominator, bias_corrections, check_common, check_step_count
from dsrun.optim.rank_state import RangeRead, mean_into


class ZeroOneAdam(OneBitOptimizer):
    """DeepSpeed's ``deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam`` (module docstring)."""

    supported_stages = (0,)

    def __init__(self, params: Iterable[Any], deepspeed: Any = None, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl"):
        beta1, beta2 = check_common(lr, betas, eps, weight_decay, max_grad_norm, amsgrad, "ZeroOneAdam")
        self.var_freeze_step = check_step_count(var_freeze_step, "var_freeze_step")
        self.var_update_scaler = check_step_count(var_update_scaler, "var_update_scaler")
        self.local_step_scaler = check_step_count(local_step_scaler, "local_step_scaler")
        self.local_step_clipper = check_step_count(local_step_clipper, "local_step_clipper")
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=(beta1, beta2), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, deepspeed, cuda_aware, comm_backend_name)

    def _first_state(self) -> dict[str, Any]:
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    return self.state[p]
        return {}

    def reduce_next_step(self) -> bool:
        state = self._first_state()
        upcoming = state.get("step", 0) + 1
        return upcoming <= self.var_freeze_step and upcoming % state.get("var_interval", 1) == 0

    def phase_note(self) -> str:
        state = self._first_state()
        if state.get("step", 0) < self.var_freeze_step:
            return ("gradients are now all-reduced only at variance updates (every "
                    f"{state.get('var_interval', 1)} steps, growing); between them they go compressed to 1 bit")
        return f"variance frozen after step {self.var_freeze_step}: local steps with 1-bit synchronisation"

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.begin_step(closure)
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.moment_state(p, var_interval=1, var_counter=0, variance_updates=0,
                                          local_step_interval=1, local_step_counter=0, lrs=0.0)
                state["step"] += 1
                if state["step"] <= self.var_freeze_step:
                    self._learning_variance(gi, p, state, group)
                else:
                    self._local_step(gi, p, state, group)
        return loss

    def _update(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        """The Adam update of ``p``; returns the denominator it used."""
        beta1, beta2 = group["betas"]
        bias1, bias2 = bias_corrections(group["bias_correction"], beta1, beta2, state["step"],
                                        state["variance_updates"])
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        denom = adam_denominator(state["exp_avg_sq"], bias2, group["eps"], self.eps_inside_sqrt)
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias1)
        return denom

    def _learning_variance(self, gi: int, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        variance_step = state["step"] % state["var_interval"] == 0
        if variance_step:  # the all-reduced gradient
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["variance_updates"] += 1
        else:
            grad = p.grad
            if self.world_size > 1:
                grad = self.mask(gi, self.own_part(gi, self.exchange(gi, p.grad.float())))
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        self._update(p, state, group)
        if variance_step:
            state["var_counter"] += 1
            if state["var_counter"] == self.var_update_scaler:
                state["var_counter"] = 0
                state["var_interval"] *= 2

    def _local_step(self, gi: int, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        beta1 = group["betas"][0]
        if "synced_param" not in state:  # the first local step: the errors now measure another quantity
            state["synced_param"] = p.detach().clone()
            if self.worker_errors and self.worker_errors[gi] is not None:
                self.worker_errors[gi].zero_()
                self.server_errors[gi].zero_()
        self.mask(gi, state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1))  # masked here too: always 0
        state["lrs"] += group["lr"]
        denom = self._update(p, state, group)
        if group["weight_decay"]:  # what the decay did to the synchronised point since it was taken
            state["decay"] = state.get("decay", 1.0) * (1 - group["lr"] * group["weight_decay"])
        if state["step"] % state["local_step_interval"] == 0:
            self._synchronise(gi, p, state, group, denom)
        state["local_step_counter"] += 1
        if state["local_step_counter"] == self.local_step_scaler:
            state["local_step_counter"] = 0
            state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)

    def _synchronise(self, gi: int, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
                     denom: torch.Tensor) -> None:
        synced, decay = state["synced_param"], state.get("decay", 1.0)
        moved = torch.sub(p, synced, alpha=decay).mul_(denom)  # minus the lr-weighted sum of the local momenta
        if self.world_size > 1:
            moved = self.own_part(gi, self.exchange(gi, moved))
        self.mask(gi, moved)
        if state["lrs"] > 0:
            bias1 = 1.0 - group["betas"][0] ** state["step"] if group["bias_correction"] else 1.0
            state["exp_avg"].copy_(moved).mul_(-bias1 / state["lrs"])
        p.copy_(synced).mul_(decay).addcdiv_(moved, denom)
        synced.copy_(p)
        state["lrs"], state["decay"] = 0.0, 1.0

    # --- rank state: between synchronisations each rank's weights and momentum are its own ----------------
    def rank_state_dict(self) -> dict[str, Any]:
        out = super().rank_state_dict()
        local = []
        for group in self.param_groups:
            p = group["params"][0]
            state = self.state.get(p, {})
            local.append({"param": p.detach().cpu().clone(), "exp_avg": state["exp_avg"].detach().cpu().clone()}
                         if "synced_param" in state else None)
        out["local"] = local
        return out

    def load_rank_extras(self, states: list[dict[str, Any]], exact: bool, read: RangeRead) -> None:
        if not states:
            return
        for gi, group in enumerate(self.param_groups):
            p = group["params"][0]
            saved = [s["local"][gi] for s in states if gi < len(s.get("local", [])) and s["local"][gi] is not None]
            if not saved or saved[0]["param"].numel() != p.numel() or "synced_param" not in self.state.get(p, {}):
                continue
            # same world: this rank's own; another world size: the saved ranks' mean (read a chunk at a time)
            mean_into(p.data.view(-1), [(s["param"], 0) for s in saved], read)
            mean_into(self.state[p]["exp_avg"].view(-1), [(s["exp_avg"], 0) for s in saved], read)
