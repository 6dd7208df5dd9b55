"""Optimizers by DeepSpeed name.

``optimizer.type`` in a DeepSpeed config is matched case-insensitively against DeepSpeed's own names
(Adam, AdamW, Lamb, Lion, Adagrad, Muon); anything else is looked up in ``torch.optim`` (exact case first, then
case-insensitively, so ``sgd`` finds ``SGD``). Adam and AdamW use the compiled CPU op
(``dsrun.ops.adam.DeepSpeedCPUAdam``, built on first use) when the model lives on the CPU; otherwise torch's
``Adam``/``AdamW`` (or dsrun's torch Adam for options torch lacks). DeepSpeed's "Adam" decays weights
AdamW-style unless ``"adam_w_mode": false``; ``"torch_adam": true`` forces torch's implementation. "Muon" is
DeepSpeed's ``MuonWithAuxAdam`` over its two groups (:mod:`dsrun.optim.muon`), not ``torch.optim.Muon``.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Iterable

import torch

from dsrun.utils.errors import ConfigError, Problem, show
from dsrun.utils.suggest import did_you_mean

from .adam import Adam
from .lamb import Lamb
from .lion import Lion
from .muon.optimizer import MuonWithAuxAdam, muon_param_groups

NATIVE_NAMES = {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "lion": "Lion", "adagrad": "Adagrad",
                "muon": "Muon"}
# the mup package's optimizers: dsrun cannot build them (the config layer refuses them first, with the same
# reason, from its support ledger; this guards direct calls)
MUP_NAMES = {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}
# built by the engine (dsrun.optim.onebit, a layer above): they communicate by themselves
ENGINE_BUILT_NAMES = {"onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb"}
# Optimizer classes ZeRO is tested with; others need "zero_allow_untested_optimizer": true.
ZERO_TESTED_CLASS_NAMES = frozenset({"Adam", "AdamW", "Lamb", "Lion", "Adagrad", "DeepSpeedCPUAdam",
                                     "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "FusedAdam", "FusedLamb",
                                     "OnebitAdam", "OnebitLamb", "MuonWithAuxAdam"})  # the 1-bit pair: stage 1 (docs/onebit.md)


def compiled_cpu_adam() -> type | None:
    """``DeepSpeedCPUAdam`` when the compiled-ops package is importable, else None.

    The choice does not depend on whether the kernel happens to be in the build cache: the op builds itself
    on first use (cached afterwards) and falls back to its own torch path, with one warning, only where no
    C++ compiler exists. So the same config always trains with the same optimizer code.
    """
    try:
        module = importlib.import_module("dsrun.ops.adam")
    except ImportError:
        return None
    return getattr(module, "DeepSpeedCPUAdam", None)


def _torch_optim_class(name: str) -> type | None:
    candidates = {n: getattr(torch.optim, n) for n in dir(torch.optim)
                  if not n.startswith("_") and inspect.isclass(getattr(torch.optim, n))
                  and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    if name in candidates:
        return candidates[name]
    lowered = {n.lower(): cls for n, cls in candidates.items()}
    return lowered.get(name.lower())


def _adam(params: Iterable[Any], kwargs: dict[str, Any], force_w_mode: bool, on_cpu: bool) -> torch.optim.Optimizer:
    kwargs = dict(kwargs)
    adam_w_mode = True if force_w_mode else bool(kwargs.pop("adam_w_mode", True))
    kwargs.pop("adam_w_mode", None)
    torch_adam = bool(kwargs.pop("torch_adam", False))
    bias_correction = bool(kwargs.pop("bias_correction", True))
    compiled = None if torch_adam or not on_cpu else compiled_cpu_adam()
    if compiled is not None:
        return compiled(params, bias_correction=bias_correction, adamw_mode=adam_w_mode, **kwargs)
    if bias_correction:
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        if cls is torch.optim.AdamW and not torch_adam:
            # standing in for DeepSpeed's FusedAdam/CPU Adam, whose weight decay defaults to 0; with torch_adam
            # DeepSpeed builds torch.optim.AdamW itself, with torch's default of 0.01
            kwargs.setdefault("weight_decay", 0.0)
        return cls(params, **kwargs)
    return Adam(params, bias_correction=False, adam_w_mode=adam_w_mode, **kwargs)


def build_optimizer(type_name: str, params: Iterable[Any], optimizer_params: dict[str, Any] | None = None,
                    on_cpu: bool = True, offload: bool = False) -> torch.optim.Optimizer:
    """Build the optimizer a DeepSpeed config names, over ``params`` (tensors or param-group dicts).

    ``offload`` (ZeRO-Offload of the optimizer): Adagrad and Lion become ``DeepSpeedCPUAdagrad`` /
    ``DeepSpeedCPULion`` (Adam/AdamW already take ``DeepSpeedCPUAdam`` with ``on_cpu``), as DeepSpeed does."""
    kwargs = dict(optimizer_params or {})
    key = type_name.lower()
    if key in MUP_NAMES:
        raise ConfigError(Problem("optimizer.type", f"got {show(type_name)}: MuAdam/MuAdamW/MuSGD are the mup "
                                  "package's optimizers (maximal update parametrization), not implemented in this "
                                  "version of dsrun", "use Adam, AdamW, Lamb or Lion, or pass a mup optimizer to "
                                  "initialize(optimizer=...)"))
    if key in ENGINE_BUILT_NAMES:
        raise ConfigError(Problem("optimizer.type", f"{ENGINE_BUILT_NAMES[key]} communicates by itself and is "
                                  "built by dsrun.initialize (or dsrun.optim.onebit), not by the registry",
                                  "pass the config to dsrun.initialize"))
    try:
        if key == "adam":
            return _adam(params, kwargs, force_w_mode=False, on_cpu=on_cpu)
        if key == "adamw":
            return _adam(params, kwargs, force_w_mode=True, on_cpu=on_cpu)
        if key == "lamb":
            return Lamb(params, **kwargs)
        if key == "lion":
            if offload:
                from dsrun.ops.lion import DeepSpeedCPULion

                return DeepSpeedCPULion(params, **kwargs)
            return Lion(params, **kwargs)
        if key == "muon":
            return MuonWithAuxAdam(muon_param_groups(params, kwargs))
        if key == "adagrad":
            if offload:
                from dsrun.ops.adagrad import DeepSpeedCPUAdagrad

                return DeepSpeedCPUAdagrad(params, **kwargs)
            return torch.optim.Adagrad(params, **kwargs)
        cls = _torch_optim_class(type_name)
    except TypeError as exc:  # a params key the constructor does not take
        raise ConfigError(Problem("optimizer.params", f"{type_name} rejected the params {show(kwargs)}: {exc}",
                                  "params must be keyword arguments of the optimizer's constructor")) from None
    if cls is None:
        choices = list(NATIVE_NAMES.values()) + [n for n in dir(torch.optim) if n[:1].isupper()]
        raise ConfigError(Problem("optimizer.type", f"got {show(type_name)}; allowed: "
                                  f"{', '.join(NATIVE_NAMES.values())} (any case) or a torch.optim class",
                                  did_you_mean(type_name, choices)))
    try:
        return cls(params, **kwargs)
    except TypeError as exc:
        raise ConfigError(Problem("optimizer.params", f"{cls.__name__} rejected the params {show(kwargs)}: {exc}",
                                  "params must be keyword arguments of the optimizer's constructor")) from None


def is_zero_supported_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """True for the optimizer classes ZeRO is tested with (by class name, so wrappers of the same name count)."""
    return type(optimizer).__name__ in ZERO_TESTED_CLASS_NAMES


def check_zero_optimizer(optimizer: torch.optim.Optimizer, zero_stage: int, allow_untested: bool) -> None:
    """DeepSpeed's rule: ZeRO (stage > 0) with an untested optimizer needs ``zero_allow_untested_optimizer``."""
    if zero_stage > 0 and not allow_untested and not is_zero_supported_optimizer(optimizer):
        raise ConfigError(Problem(
            "zero_allow_untested_optimizer",
            f"ZeRO stage {zero_stage} is not tested with {type(optimizer).__name__}",
            "add \"zero_allow_untested_optimizer\": true to the config to use it anyway, or pick "
            "Adam, AdamW, Lamb, Lion, Adagrad or Muon"))
