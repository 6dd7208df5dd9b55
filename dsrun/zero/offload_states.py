"""``deepspeed.runtime.zero.offload_states``: ``engine.offload_states()`` / ``reload_states()`` at ZeRO stages 1-3.

Between two phases that need the accelerator's memory for something else (generation in RLHF, a second model),
a training engine moves its states to host memory and brings them back before it trains again. Each ZeRO
strategy of stages 1-3 is a :class:`StatesOffload`: it names the tensors of each state
(:class:`~dsrun.offload.state_moves.OffloadStateTypeEnum`; stages 1-2 in :mod:`.partitioned`, stage 3 in
:mod:`.stage3` and its shard stores) and :class:`~dsrun.offload.state_moves.HostCopies` moves them, keeping every
tensor's identity, so training continues exactly as if nothing had moved.

What happens where (the tensors on the host already stay there; DeepSpeed's ``_refine_include_states`` drops
the same states for ``offload_optimizer``):

* **CUDA**: each named state's device tensors go to host memory (page-locked with ``pin_memory``), the device
  memory is freed; ``reload_states`` copies them back.
* **CPU training device**: the states already live in host memory, so nothing is copied (a copy would only
  double the memory); the call records which states were named, and logs once that they stay where they are.
  Buffers that hold no state between steps are really released on any device: the gradient buckets kept for
  reuse (``contiguous_grad_buffer``, stages 2-3) and, at stage 3, the gathered copies of parameters (DeepSpeed
  empties the partition cache first too).

Refused, each with one line: stage 0 and an engine without an optimizer (DeepSpeed has no offload there),
``offload_param`` (the parameters already live off the device), ``device`` ``nvme`` (DeepSpeed refuses it too),
a ZeRO++/MiCS/hpZ run (its secondary and quantized partitions are not states this moves), and names that are
not :class:`OffloadStateTypeEnum` values. ``device: none`` does nothing, with a warning, as in DeepSpeed.
Unlike DeepSpeed's stage 3, any optimizer's state moves (every tensor in its state), not only ``FusedAdam``'s.
Train only after ``reload_states``: between the two calls the states are where the offload put them.
"""
from __future__ import annotations

import logging
from typing import Any, Container, Iterable

import torch

from dsrun.offload.state_moves import HostCopies, OffloadDeviceEnum, OffloadStateTypeEnum, StateTensor
from dsrun.utils.errors import Problem, UserError, show

log = logging.getLogger("dsrun.zero")


class OffloadStatesError(UserError, ValueError):
    """``offload_states`` cannot do what was asked (a ValueError, as DeepSpeed raises for ``nvme``)."""


class StatesOffload:
    """The part of a ZeRO strategy (stages 1-3) that moves its states to host memory and back."""

    _host_copies: HostCopies | None = None
    _told_host: bool = False

    # --- what each strategy says ----------------------------------------------------------------------------
    def state_tensors(self, state: OffloadStateTypeEnum) -> list[StateTensor]:
        """The tensors ``state`` names here, with the views of their storage (not ``contiguous_grad_buffer``)."""
        raise NotImplementedError

    def gradient_buckets(self) -> list[torch.Tensor]:
        """The gradient buffers kept for reuse between buckets and steps (``contiguous_grad_buffer``)."""
        return []

    def release_gradient_buckets(self) -> list[torch.Tensor]:
        """Drop :meth:`gradient_buckets` (the owner allocates again when it needs one); returns what it dropped."""
        return []

    def keep_gradient_buckets(self, buffers: list[torch.Tensor]) -> None:
        """Take back (reallocated, uninitialised) buffers released by :meth:`release_gradient_buckets`."""

    def before_offload(self) -> None:
        """Release what is rebuilt on demand before the states move (stage 3: the gathered parameters)."""

    def offload_refusal(self) -> str | None:
        """Why this strategy cannot move its states (None: it can)."""
        return None

    # --- the operations -----------------------------------------------------------------------------------
    @property
    def host_copies(self) -> HostCopies:
        if self._host_copies is None:
            self._host_copies = HostCopies()
        return self._host_copies

    @property
    def offloaded_states(self) -> set[OffloadStateTypeEnum]:
        """The states named by ``offload_states`` since the last ``reload_states`` (DeepSpeed's attribute)."""
        return set(self.host_copies.offloaded)

    def offload_states(self, include: Container[OffloadStateTypeEnum] | None = None,
                       device: OffloadDeviceEnum = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the ``include`` d states (all when None) to host memory; see the module's docstring."""
        copies = self.host_copies
        self.before_offload()
        for state in OffloadStateTypeEnum:  # a fixed order: views shared by two states move with the first
            if (include is not None and state not in include) or state in copies.offloaded:
                continue
            if state is OffloadStateTypeEnum.contiguous_grad_buffer:
                copies.release(self.release_gradient_buckets())
            else:
                copies.offload(state, self.state_tensors(state), pin_memory, non_blocking)
        stayed = sorted(s.value for s in copies.already_host if s is not OffloadStateTypeEnum.contiguous_grad_buffer)
        if stayed and not self._told_host:
            self._told_host = True
            log.warning("offload_states: %s already live in host memory (a CPU training device, or offload_optimizer) "
                        "and stay where they are; nothing of them is copied", ", ".join(stayed))
        if copies.moved and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the freed device memory goes back to the driver, as DeepSpeed does

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring every state ``offload_states`` moved back to where it was; released buckets are reallocated."""
        self.keep_gradient_buckets(self.host_copies.reload(non_blocking))

    def state_devices(self, state: OffloadStateTypeEnum) -> set[torch.device]:
        """The devices the tensors of ``state`` are on now (``contiguous_grad_buffer``: the kept buckets')."""
        if state is OffloadStateTypeEnum.contiguous_grad_buffer:
            return {b.device for b in self.gradient_buckets()}
        return {item.tensor.device for item in self.state_tensors(state)}

    def close_state_copies(self) -> None:
        if self._host_copies is not None:
            self._host_copies.close()


def _make_offload_state_key(key: str) -> str:
    """The key of the host buffer a state ``key`` is offloaded into, beside it in the optimizer's state
    (DeepSpeed's name; DeepCompile's optimizer-state offload keeps Adam's moments there)."""
    return f"{key}_offload_buffer"


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> list[StateTensor]:
    """Every tensor in ``optimizer``'s state of ``params`` (Adam's ``exp_avg``, ``exp_avg_sq``, a tensor step)."""
    return [StateTensor(value) for p in params for value in optimizer.state.get(p, {}).values()
            if torch.is_tensor(value)]


def _states(include: Any) -> list[OffloadStateTypeEnum] | None:
    if include is None:
        return None
    if isinstance(include, (str, OffloadStateTypeEnum)) or not isinstance(include, Iterable):
        raise OffloadStatesError(Problem("offload_states(include=...)", f"got {show(include)}; a list of "
                                         "OffloadStateTypeEnum values, or None for all",
                                         f"include=[OffloadStateTypeEnum.{getattr(include, 'name', include)}]"))
    states = []
    for name in include:
        try:
            states.append(OffloadStateTypeEnum(name))
        except ValueError:
            allowed = ", ".join(s.value for s in OffloadStateTypeEnum)
            raise OffloadStatesError(Problem("offload_states(include=...)", f"{show(name)} is not a state; "
                                             f"allowed: {allowed}")) from None
    return states


def refusal(strategy: Any, offload_param_device: str) -> str | None:
    """Why the engine holding ``strategy`` cannot move its states (DeepSpeed's refusals), else None."""
    if strategy is None:
        return "the engine has no optimizer, so there are no optimizer states to move"
    if not isinstance(strategy, StatesOffload):
        return f"ZeRO stage {strategy.stage} keeps no offloadable states (DeepSpeed offers it at stages 1-3)"
    if offload_param_device not in ("none", None):
        return f"offload_param puts the parameters on {offload_param_device} already; states are not moved then"
    return strategy.offload_refusal()


def offload_engine_states(strategy: Any, offload_param_device: str, include: Any = None,
                          device: Any = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                          non_blocking: bool = False) -> None:
    """``engine.offload_states``: check the request as DeepSpeed does, then have ``strategy`` move its states."""
    states = _states(include)
    why = refusal(strategy, offload_param_device)
    if why is not None:
        raise OffloadStatesError(Problem("offload_states", why))
    try:
        target = OffloadDeviceEnum(getattr(device, "value", device))
    except ValueError:
        target = None
    if target is OffloadDeviceEnum.none:
        log.warning("offload_states: no device specified for offloading states (device=none); nothing moved")
        return
    if target is not OffloadDeviceEnum.cpu:
        raise OffloadStatesError(Problem("offload_states(device=...)", f"got {show(device)}; only "
                                         "OffloadDeviceEnum.cpu is supported (as in DeepSpeed: not nvme)"))
    strategy.offload_states(include=states, device=target, pin_memory=bool(pin_memory),
                            non_blocking=bool(non_blocking))


def reload_engine_states(strategy: Any, non_blocking: bool = False) -> None:
    """``engine.reload_states``: refused where ``offload_states`` is."""
    if strategy is None or not isinstance(strategy, StatesOffload):
        raise OffloadStatesError(Problem("reload_states", refusal(strategy, "none") or ""))
    strategy.reload_states(non_blocking=bool(non_blocking))


def get_state_devices(model: Any, state: OffloadStateTypeEnum) -> set[torch.device]:
    """The devices the tensors of ``state`` of engine ``model`` are on now (DeepSpeed's helper of the same name;
    ``contiguous_grad_buffer``: empty while the buckets are released)."""
    strategy = getattr(model, "strategy", None)
    if not isinstance(strategy, StatesOffload):
        raise OffloadStatesError(Problem("get_state_devices", refusal(strategy, "none") or ""))
    return strategy.state_devices(OffloadStateTypeEnum(state))


__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "OffloadStatesError", "StatesOffload", "get_state_devices",
           "offload_engine_states", "optimizer_state_tensors", "reload_engine_states"]
