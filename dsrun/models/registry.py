"""Named model sizes (``conf/model/*.yaml``) and building any model from a ``_target_`` spec.

The memory estimator and the autotuner use :func:`build_model` with ``device="meta"`` to size a model
without allocating it; the worker uses it to build the real one.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from dsrun.models.config import GPTConfig
from dsrun.utils.errors import ConfigError, Problem
from dsrun.utils.paths import conf_dir
from dsrun.utils.suggest import did_you_mean

GPT_TARGET = "dsrun.models.gpt.GPT"


def _model_dir() -> Path:
    return conf_dir() / "model"


def model_names() -> list[str]:
    """Names of the model configs shipped in ``conf/model/`` (``gpt-nano`` ... ``gpt-13b``)."""
    return sorted(p.stem for p in _model_dir().glob("*.yaml"))


def model_spec(name: str) -> dict[str, Any]:
    """The ``_target_`` + keyword-argument mapping of a named model config, as a plain dict."""
    from omegaconf import OmegaConf

    path = _model_dir() / f"{name}.yaml"
    if not path.is_file():
        names = model_names()
        raise ConfigError(Problem("model", f"no model config named '{name}'; available: " + ", ".join(names),
                                  did_you_mean(name, names)))
    spec = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(spec, dict)
    return spec


def gpt_config(name_or_spec: str | Mapping[str, Any]) -> GPTConfig:
    """The :class:`GPTConfig` of a named size or of a ``_target_: dsrun.models.gpt.GPT`` mapping."""
    spec = model_spec(name_or_spec) if isinstance(name_or_spec, str) else dict(name_or_spec)
    target = spec.pop("_target_", GPT_TARGET)
    if target != GPT_TARGET:
        raise ConfigError(Problem("model._target_", f"'{target}' is not the built-in GPT",
                                  "build it with build_model() and count it with num_parameters()"))
    return GPTConfig.from_kwargs(spec)


def build_model(name_or_spec: str | Mapping[str, Any] | GPTConfig, device: str | torch.device | None = None,
                **overrides: object) -> nn.Module:
    """Build a model from a size name, a ``_target_`` mapping (any importable class or function) or a
    :class:`GPTConfig`; ``device="meta"`` builds it without allocating memory.

    ``overrides`` replace keys of the spec (e.g. ``vocab_size=256``; any value the target takes).
    """
    from dsrun.models.gpt import GPT

    if isinstance(name_or_spec, GPTConfig):
        spec: dict[str, Any] = {"_target_": GPT_TARGET, **name_or_spec.to_dict()}
    elif isinstance(name_or_spec, str):
        spec = model_spec(name_or_spec)
    else:
        spec = dict(name_or_spec)
    spec.update(overrides)
    if "_target_" not in spec:
        raise ConfigError(Problem("model._target_", "is missing", f"set it to {GPT_TARGET} or your own class"))
    with torch.device(device) if device is not None else nullcontext():
        if spec["_target_"] == GPT_TARGET:
            return GPT(**{k: v for k, v in spec.items() if k != "_target_"})
        from hydra.errors import InstantiationException
        from hydra.utils import instantiate

        try:
            return instantiate(spec)
        except InstantiationException as error:
            raise ConfigError(Problem("model._target_", f"cannot build '{spec['_target_']}': {error}",
                                      "check the import path and the keyword arguments")) from error
