"""``data_types.keep_in_fp32_modules``: the parameters and buffers that stay fp32 when dsrun casts the model to
fp16/bf16, as Hugging Face keeps a model's ``_keep_in_fp32_modules`` when it loads it in a 16-bit dtype.

Matching is Hugging Face's (transformers 5, ``core_model_loading.build_glob_alternation``): each entry is a
regular expression, ``*`` standing for ``.*``, searched (``re.search``) in a tensor's qualified name, so ``wo``
keeps T5's ``...DenseReluDense.wo.weight`` and ``gate.weight`` a router's weight alone. ``"auto"`` is the model's
own lists where Hugging Face applies them: ``_keep_in_fp32_modules_strict`` under fp16 and bf16,
``_keep_in_fp32_modules`` under fp16 only (transformers' ``_get_dtype_plan``); none for a model without them.

Every kept parameter carries ``ds_keep_fp32``; the ZeRO stages keep such a parameter's copies fp32 (its flat
group, shard and gradient reduction). The forward: a model's own lists come with code that casts what reaches
those modules (T5 casts the input of ``wo`` to ``wo.weight.dtype``), so "auto" adds nothing. A listed module
whose parameters and buffers are all kept (and which holds any) gets its floating-point inputs cast to fp32 and
hands its floating-point outputs back in the dtype its inputs came in (the model's dtype when none was
floating), so the model around it runs unchanged; an input already fp32 (T5's) gets fp32 back.
"""
from __future__ import annotations

import difflib
import re
from typing import Any

import torch

from dsrun.utils.errors import ConfigError, Problem

KEY = "data_types.keep_in_fp32_modules"
MARK = "ds_keep_fp32"  # set on every kept parameter


def _model_lists(module: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """The model's own entries that apply under ``dtype`` (Hugging Face's rule for each list)."""
    entries: list[str] = []
    if dtype in (torch.float16, torch.bfloat16):
        entries += list(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        entries += list(getattr(module, "_keep_in_fp32_modules", None) or [])
    return entries


def _nearest(entry: str, module: torch.nn.Module) -> str:
    """The qualified names of the modules whose own name is nearest ``entry``."""
    by_leaf: dict[str, str] = {}
    for name, _ in module.named_modules():
        if name:
            by_leaf.setdefault(name.rsplit(".", 1)[-1], name)
    close = difflib.get_close_matches(entry, list(by_leaf), n=3, cutoff=0.0)
    return ", ".join(by_leaf[leaf] for leaf in close) or "the model has no submodules"


def kept_names(module: torch.nn.Module, setting: str | list[str], dtype: torch.dtype) -> set[str]:
    """Qualified names of the parameters and buffers of ``module`` that stay fp32 when it is cast to ``dtype``
    (``setting``: "auto" or a list of entries). A listed entry that matches no name is refused."""
    if dtype == torch.float32:
        return set()
    listed = setting != "auto"
    entries = list(setting) if listed else _model_lists(module, dtype)
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in module.named_buffers(remove_duplicate=False)]
    kept: set[str] = set()
    for entry in entries:
        pattern = re.compile(entry.replace("*", ".*"))
        matched = {n for n in names if pattern.search(n)}
        if listed and not matched:
            raise ConfigError(Problem(KEY, f"{entry!r} matches no parameter or buffer name of the model",
                                      f"nearest modules: {_nearest(entry, module)}"))
        kept |= matched
    return kept


def keep_fp32(module: torch.nn.Module, kept: set[str], loaded: dict[str, torch.Tensor]) -> None:
    """Give the ``kept`` parameters and buffers of the cast ``module`` their ``loaded`` (pre-cast) values in fp32,
    and mark the parameters."""
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)]:
            if name in kept and loaded[name].is_floating_point():
                tensor.data = loaded[name].to(device=tensor.device, dtype=torch.float32)
                if isinstance(tensor, torch.nn.Parameter):
                    setattr(tensor, MARK, True)


def is_kept(param: torch.Tensor) -> bool:
    return bool(getattr(param, MARK, False))


def split_kept(params: list[torch.nn.Parameter], dtype: torch.dtype) -> list[tuple[torch.dtype, list]]:
    """``params`` as (dtype, parameters) runs for the flat ZeRO stages: all in ``dtype``, or the kept ones apart,
    in fp32, when there are some."""
    kept = [p for p in params if is_kept(p)]
    if not kept or dtype == torch.float32:
        return [(dtype, params)]
    rest = [p for p in params if not is_kept(p)]
    return ([(dtype, rest)] if rest else []) + [(torch.float32, kept)]


def cast_floats(value: object, dtype: torch.dtype) -> Any:
    """``value`` (any object) with every floating-point tensor (also inside lists, tuples and dicts) cast to
    ``dtype``."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


def _first_float_dtype(value: object) -> torch.dtype | None:
    if torch.is_tensor(value):
        return value.dtype if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _first_float_dtype(item)
        if found is not None:
            return found
    return None


class Fp32Islands:
    """The forward hooks of the listed modules that are wholly fp32: inputs to fp32, outputs back."""

    def __init__(self, module: torch.nn.Module, kept: set[str], model_dtype: torch.dtype):
        self.model_dtype = model_dtype
        self.handles: list[Any] = []
        kept_ids = {id(t) for n, t in [*module.named_parameters(remove_duplicate=False),
                                       *module.named_buffers(remove_duplicate=False)] if n in kept}
        inside: set[str] = set()  # an island's submodules run inside its fp32 forward
        for name, sub in module.named_modules():
            if any(not prefix or name.startswith(prefix + ".") for prefix in inside):
                continue
            tensors = [t for t in [*sub.parameters(), *sub.buffers()] if t.is_floating_point()]
            if tensors and all(id(t) in kept_ids for t in tensors):
                inside.add(name)
                self.handles.append(sub.register_forward_pre_hook(self._before, with_kwargs=True))
                self.handles.append(sub.register_forward_hook(self._after, with_kwargs=True))
        self._came_in: list[torch.dtype] = []  # per running island, the dtype its inputs came in

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._came_in.append(_first_float_dtype((args, kwargs)) or self.model_dtype)
        return cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> Any:
        return cast_floats(output, self._came_in.pop())
