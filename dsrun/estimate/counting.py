"""Counting a model's parameters the way the estimators need them, without touching its weights.

``total``: every parameter once, even when it is shared between modules (tied embeddings). DeepSpeed keys
parameters by ``data_ptr()``; on the meta device every tensor reports the same pointer, so there we key by
the parameter object instead. ``largest_layer``: the most parameters any single module owns directly
(``parameters(recurse=False)``), i.e. what ZeRO-3 must gather at once. Both work on a model built under
``torch.device("meta")``, which is how ``dsrun estimate-memory`` sizes a 10B-parameter model in a second.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts of a model: ``total`` (shared ones once), ``trainable`` (those with
    ``requires_grad``), ``largest_layer`` (most parameters owned directly by one module) and
    ``largest_layer_name`` (that module's qualified name, "" for the root)."""

    total: int
    trainable: int
    largest_layer: int
    largest_layer_name: str
    # Mixture of Experts (a model with ``moe_parameter_counts()``): every expert of every rank, and what one
    # token activates (k experts per MoE layer); ``total`` above is what one rank holds
    moe_total: int | None = None
    moe_active: int | None = None


def _storage_key(param: torch.Tensor) -> Any:
    if param.device.type == "meta":
        return ("id", id(param))
    return ("ptr", param.data_ptr())


def count_parameters(model: torch.nn.Module) -> ParameterCounts:
    """Count ``model``'s parameters; works for real and meta-device models alike."""
    sizes: dict[Any, int] = {}
    trainable: dict[Any, int] = {}
    for param in model.parameters():
        key = _storage_key(param)
        sizes[key] = param.numel()
        if param.requires_grad:
            trainable[key] = param.numel()
    largest, largest_name = 0, ""
    for name, module in model.named_modules():
        owned = sum(p.numel() for p in module.parameters(recurse=False))
        if owned > largest:
            largest, largest_name = owned, name
    moe = getattr(model, "moe_parameter_counts", None)
    moe_total, moe_active = moe() if callable(moe) else (None, None)
    return ParameterCounts(total=sum(sizes.values()), trainable=sum(trainable.values()),
                           largest_layer=largest, largest_layer_name=largest_name, moe_total=moe_total,
                           moe_active=moe_active)


# In-place ops that only change values. On a meta tensor they change nothing we can see, and running the
# first of them (e.g. normal_) makes torch import its Python meta kernels (sympy and ~800 modules, seconds),
# so weight initialisation is skipped while a model is built on the meta device.
_VALUE_ONLY_INPLACE = frozenset({
    "normal_", "uniform_", "trunc_normal_", "fill_", "zero_", "copy_", "erfinv_", "mul_", "div_", "add_",
    "sub_", "clamp_", "clamp_min_", "clamp_max_", "exponential_", "bernoulli_", "random_", "log_normal_",
    "geometric_", "cauchy_", "sqrt_", "abs_", "neg_", "exp_", "fmod_", "remainder_", "masked_fill_",
    "index_fill_", "orthogonal_", "sign_", "tanh_", "sigmoid_", "addcmul_", "addcdiv_", "lerp_",
})


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _VALUE_ONLY_INPLACE:
            # Tensor methods pass the tensor first; torch.nn.init functions may pass it as tensor=...
            target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
            if isinstance(target, torch.Tensor) and target.device.type == "meta":
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """Build modules on the meta device: shapes and dtypes only, no memory for weights, no initialisation."""
    with torch.device("meta"), _SkipMetaInit():
        yield


def instantiate_on_meta(model_cfg: Mapping[str, Any]) -> torch.nn.Module:
    """Instantiate a Hydra model config (a mapping with ``_target_``) on the meta device."""
    import hydra.utils

    with meta_device():
        model = hydra.utils.instantiate(model_cfg, _convert_="all")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model config built a {type(model).__name__}, not a torch.nn.Module")
    return model
