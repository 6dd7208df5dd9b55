"""What the CPU optimizers share: state layout, low-precision master copies, one kernel call per group.

Parameter and state dtypes:

- fp32 parameters: the kernel updates them in place; states are fp32 (``fp32_optimizer_states=True``) or bf16.
- bf16/fp16 parameters with ``fp32_optimizer_states=True`` (the default): the optimizer keeps an fp32 master
  copy in ``state["master_param"]`` and fp32 states; each step updates the master and writes the rounded
  low-precision value back to the parameter in the same pass.
- bf16/fp16 parameters with ``fp32_optimizer_states=False``: as in DeepSpeed, states take a 16-bit dtype
  (bf16; fp16 would underflow the second moment) and the parameter is updated directly, with no master copy.
  This halves optimizer memory and traffic at the cost of update precision.

Gradients may be fp32 or the parameter's 16-bit dtype; arithmetic is always fp32.

State memory: ``DSRUN_OPTIM_HUGE_PAGES=1`` (with the compiled op) gives every state tensor (moments, master
copy) of 2 MiB or more its own 2 MiB-aligned mapping advised ``MADV_HUGEPAGE`` (``empty_state`` in
``csrc/includes/dsrun_optim.h``). It is off by default: it made no consistent difference in
``benchmarks/cpu_adam.py``. Otherwise states are ordinary torch tensors.
"""
from __future__ import annotations

import contextlib
import copy
import os
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

from dsrun.ops.loader import load_op
from dsrun.utils.dynamo_free import DynamoFreeOptimizer

_EMPTY = torch.empty(0)


_LOADING = threading.local()


@contextlib.contextmanager
def adopting_loaded_state() -> Iterator[None]:
    """Within it (this thread), a CPU optimizer's ``load_state_dict`` keeps each loaded state tensor that is a
    whole CPU tensor of its own as it is, instead of copying it into its own memory: for a caller that hands over
    tensors it will not use again (a resharded checkpoint load, dsrun/checkpoint/engine_io.py), so the load holds
    one copy of the optimizer state, not two. Outside it a load copies (two optimizers never share state)."""
    before = getattr(_LOADING, "adopt", False)
    _LOADING.adopt = True
    try:
        yield
    finally:
        _LOADING.adopt = before

class CPUOptimizer(DynamoFreeOptimizer):
    """Base class: subclasses name their op, their state keys, and implement ``_kernel`` and ``_fallback``."""

    OP_NAME = ""
    STATE_KEYS: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], fp32_optimizer_states: bool = True):
        super().__init__(params, defaults)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        # None means the compiled op is unavailable and the torch fallback runs (a warning was given).
        self.op = load_op(self.OP_NAME)

    def __getstate__(self) -> dict[str, Any]:
        # the compiled module cannot be pickled or deep-copied; it is looked up again on unpickling
        return {k: v for k, v in self.__dict__.items() if k != "op"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.op = load_op(self.OP_NAME)

    @property
    def uses_compiled_op(self) -> bool:
        return self.op is not None

    def _state_dtype(self) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else torch.bfloat16

    def _new_state(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled state tensor: in huge-page memory with DSRUN_OPTIM_HUGE_PAGES=1 (see the module doc)."""
        if self._huge_pages():
            return self.op.empty_state(list(shape), dtype)
        return torch.zeros(shape, dtype=dtype)

    def _init_state(self, p: torch.Tensor, master_copy: bool = True) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            if p.dtype != torch.float32 and self.fp32_optimizer_states and master_copy:
                state["master_param"] = self._new_state(p.shape, torch.float32).copy_(p.detach())
            for key in self.STATE_KEYS:
                state[key] = self._new_state(p.shape, self._state_dtype())
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient; returns ``closure()``'s loss if a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            work = _GroupWork()
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if p.device.type != "cpu":
                    raise RuntimeError(f"{type(self).__name__} updates CPU tensors; got a parameter on {p.device}")
                state = self._init_state(p)
                state["step"] = int(state["step"]) + 1  # a torch checkpoint stores it as a tensor
                work.add(p, state, self.STATE_KEYS)
            if work.params:
                if self.op is not None:
                    self._kernel(group, work)
                else:
                    self._fallback(group, work)
                work.finish()
        return loss

    # --- tiles: what ZeRO-Offload steps (a slice of a flat fp32 master, its gradient and its states) -------
    def state_for(self, p: torch.Tensor, master_copy: bool = True) -> dict[str, Any]:
        """``p``'s state, created (step 0, zero moments) if it has none yet. ``master_copy=False``: a 16-bit ``p``
        is itself the master the tiles update (ZeRO-Offload's fp16 masters): no fp32 copy of it is made."""
        return self._init_state(p, master_copy)

    @torch.no_grad()
    def update_tile(self, group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor,
                    states: dict[str, torch.Tensor], step: int, low_precision: torch.Tensor | None = None) -> None:
        """One update of explicit tensors with ``group``'s hyper-parameters: ``param`` (fp32, or a 16-bit
        tensor updated directly) from ``grad``, with ``states[key]`` for each of ``STATE_KEYS`` and the step
        count ``step`` (already incremented). When ``low_precision`` (bf16/fp16) is given the updated value
        is also written there, rounded, in the same pass. All tensors contiguous and of ``param``'s size;
        views (tiles of larger tensors) are fine. Off the CPU the torch implementation runs instead."""
        work = _GroupWork()
        work.params.append(param)
        work.grads.append(grad)
        work.low_precision.append(_EMPTY if low_precision is None else low_precision)
        for key in self.STATE_KEYS:
            work.states.setdefault(key, []).append(states[key])
        work.steps.append(int(step))
        if self.op is not None and param.device.type == "cpu":
            self._kernel(group, work)
        else:
            self._fallback(group, work)

    def _kernel(self, group: dict[str, Any], work: "_GroupWork") -> None:
        raise NotImplementedError

    def _fallback(self, group: dict[str, Any], work: "_GroupWork") -> None:
        raise NotImplementedError

    def _loaded_state(self, value: torch.Tensor) -> torch.Tensor:
        """A loaded state tensor as this optimizer keeps it: a copy in its own memory (huge pages, above), or,
        inside :func:`adopting_loaded_state`, the tensor itself when it is a whole CPU tensor of its own."""
        value = value.detach()
        whole = (value.device.type == "cpu" and value.is_contiguous() and value.storage_offset() == 0
                 and value.untyped_storage().nbytes() == value.nbytes)
        if whole and getattr(_LOADING, "adopt", False) and not self._huge_pages():
            return value
        return self._new_state(value.shape, value.dtype).copy_(value)

    def _huge_pages(self) -> bool:
        return self.op is not None and os.environ.get("DSRUN_OPTIM_HUGE_PAGES", "0") == "1"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Like torch's, but keeps each state tensor's saved dtype: torch would cast the fp32 master copy and
        states of a bf16 parameter to bf16, losing their precision."""
        saved_state = state_dict["state"]
        stripped = {**state_dict, "state": {}}
        super().load_state_dict(stripped)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for param_id, p in zip(saved_ids, params):
            if param_id not in saved_state:
                continue
            self.state[p] = {k: (self._loaded_state(v) if torch.is_tensor(v) else copy.deepcopy(v))
                             for k, v in saved_state[param_id].items()}


class _GroupWork:
    """The tensors of one param group that get updated this step, laid out as the kernels want them."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []  # what the kernel updates: the master copy or the parameter
        self.grads: list[torch.Tensor] = []
        self.low_precision: list[torch.Tensor] = []  # the 16-bit parameter to write, or an empty tensor
        self.states: dict[str, list[torch.Tensor]] = {}
        self.steps: list[int] = []
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, p: torch.Tensor, state: dict[str, Any], keys: tuple[str, ...]) -> None:
        data = p.detach()
        if not data.is_contiguous():  # rare (e.g. a transposed view); update a copy and write it back
            contiguous = data.contiguous()
            self._copy_back.append((data, contiguous))
            data = contiguous
        if "master_param" in state:
            self.params.append(state["master_param"])
            self.low_precision.append(data)
        else:
            self.params.append(data)
            self.low_precision.append(_EMPTY)
        self.grads.append(p.grad.detach().contiguous())
        for key in keys:
            self.states.setdefault(key, []).append(state[key])
        self.steps.append(int(state["step"]))

    @property
    def has_low_precision(self) -> bool:
        return any(t.numel() for t in self.low_precision)

    def finish(self) -> None:
        for target, updated in self._copy_back:
            target.copy_(updated)
