"""DeepSpeed's ``deepspeed.utils.safe_get_*`` / ``safe_set_*``: read and change a parameter's fp32 master
weight, gradient and optimizer state under any ZeRO stage (0-3, offloaded or not).

The engine's ZeRO strategy gives every parameter it trains a fragment (``param._dsrun_fragment``, see
:mod:`dsrun.zero.fragments`) that knows where this rank's piece of the parameter lives; these
functions only dispatch to it, so this module needs nothing from the layers above.

* ``safe_get_full_*`` return the whole value, shaped like the parameter. **Collective**: every rank of the
  data-parallel group must call them, for the same parameters in the same order, or the job hangs.
* ``safe_set_full_*`` take the whole value (the same on every rank) and change training exactly as
  assigning it in plain PyTorch would: the master, the optimizer state and the model's copy all follow.
* ``safe_set_full_grad`` / ``safe_set_local_grad`` / ``safe_update_full_grad_vectorized`` replace the gradient
  the next step applies (between backward and ``step()``), in the same units the getters give.
* ``safe_get_local_*`` / ``safe_set_local_*`` read or write this rank's piece only (not collective): the whole
  parameter at stage 0, the part inside this rank's partition at stages 1-2, the shard (with its zero
  padding) at stage 3.
* Gradients are the averaged gradients the next step applies (loss scale removed, before clipping), valid
  after the backward of a gradient-accumulation boundary and before ``step()``.
* A parameter the engine does not train (frozen, or an engine without optimizer) gives ``None`` from the
  getters, as in DeepSpeed (``safe_get_full_grad`` then returns ``param.grad``).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

FRAGMENT_ATTR = "_dsrun_fragment"


class TensorFragment(Protocol):
    """What these functions ask of ``param._dsrun_fragment`` (the ZeRO strategy's fragment of one parameter)."""

    def full_fp32(self) -> torch.Tensor: ...
    def local_fp32(self) -> torch.Tensor: ...
    def set_full_fp32(self, value: torch.Tensor) -> None: ...
    def set_local_fp32(self, value: torch.Tensor) -> None: ...
    def full_grad(self) -> torch.Tensor | None: ...
    def local_grad(self) -> torch.Tensor | None: ...
    def full_optimizer_state(self, key: str) -> torch.Tensor: ...
    def local_optimizer_state(self, key: str) -> torch.Tensor: ...
    def set_full_optimizer_state(self, value: torch.Tensor, key: str) -> None: ...
    def set_full_grad(self, value: torch.Tensor) -> None: ...
    def set_local_grad(self, value: torch.Tensor) -> None: ...
    def set_local_optimizer_state(self, value: torch.Tensor, key: str) -> None: ...


def _fragment(param: torch.Tensor) -> TensorFragment | None:
    return getattr(param, FRAGMENT_ATTR, None)


def _require(param: torch.Tensor, what: str) -> TensorFragment:
    fragment = _fragment(param)
    if fragment is None:
        raise ValueError(f"{what}: this parameter is not trained by a dsrun engine (frozen, not in the "
                         "optimizer, or no engine built yet); call it on a parameter of engine.module")
    return fragment


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The full fp32 master value of ``param`` (collective)."""
    fragment = _fragment(param)
    return fragment.full_fp32() if fragment is not None else None


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master and model value to ``value`` (full shape, the same on every rank)."""
    _require(param, "safe_set_full_fp32_param").set_full_fp32(value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The full optimizer state ``optim_state_key`` (e.g. ``exp_avg``, ``exp_avg_sq``) of ``param``
    (collective)."""
    fragment = _fragment(param)
    return fragment.full_optimizer_state(optim_state_key) if fragment is not None else None


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set ``param``'s optimizer state ``optim_state_key`` to ``value`` (full shape, the same on every rank);
    the state must exist (optimizers create it at their first step)."""
    _require(param, "safe_set_full_optimizer_state").set_full_optimizer_state(value, optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The full averaged gradient of ``param`` the next step applies (collective)."""
    fragment = _fragment(param)
    if fragment is None:
        return getattr(param, "grad", None)
    return fragment.full_grad()


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the full averaged gradient of ``param`` the next step applies to ``value`` (full shape, the same on
    every rank): DeepSpeed's setter, e.g. for clipping or masking gradients between backward and step."""
    fragment = _fragment(param)
    if fragment is None and getattr(param, "grad", None) is not None:
        param.grad.copy_(value)
        return
    _require(param, "safe_set_full_grad").set_full_grad(value)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of ``param``'s averaged gradient (the shape :func:`safe_get_local_grad` gives)."""
    _require(param, "safe_set_local_grad").set_local_grad(value)


def safe_update_full_grad_vectorized(param_list: list[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """For each parameter, set its full gradient to ``update_func(full_gradient, param)`` (collective, as the
    full getter: every rank calls it with the same list). A frozen parameter is left alone."""
    for param in param_list:
        fragment = _fragment(param)
        if fragment is not None:
            fragment.set_full_grad(update_func(fragment.full_grad(), param))
        elif getattr(param, "grad", None) is not None:
            param.grad.copy_(update_func(param.grad, param))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of ``param``'s fp32 master, flat."""
    fragment = _fragment(param)
    return fragment.local_fp32() if fragment is not None else None


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of ``param``'s averaged gradient, flat."""
    fragment = _fragment(param)
    if fragment is None:
        return getattr(param, "grad", None)
    return fragment.local_grad()


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's piece of ``param``'s optimizer state ``optim_state_key``, flat."""
    fragment = _fragment(param)
    return fragment.local_optimizer_state(optim_state_key) if fragment is not None else None


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece of ``param``'s fp32 master (and this rank's copy of those weights) to ``value``.
    At stages 1-2 the other ranks' copies of the model take the new value at the next step; at stage 3
    call it on every rank (a gathered copy is dropped and gathered again)."""
    _require(param, "safe_set_local_fp32_param").set_local_fp32(value)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's piece of ``param``'s optimizer state ``optim_state_key`` to ``value``."""
    _require(param, "safe_set_local_optimizer_state").set_local_optimizer_state(value, optim_state_key)


__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]
