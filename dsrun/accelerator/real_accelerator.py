"""``deepspeed.accelerator.real_accelerator``: which accelerator this process uses, chosen as DeepSpeed chooses.

``DS_ACCELERATOR`` (dsrun's older ``DSRUN_ACCELERATOR`` too) names one of ``SUPPORTED_ACCELERATOR_LIST``; the named
family's package must be importable (``torch_npu`` for ``npu``, ...), else a ConfigError (a ValueError, as
DeepSpeed's) says which is missing. Unset, the first family present in DeepSpeed's order is taken: XPU, NPU, SDAA,
MPS, HPU, MLU, SUPA, KLXPU, CUDA, and the CPU when none is. ``set_accelerator`` replaces the choice (an accelerator
object, or dsrun's shorthand, a family's name).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os

import torch

from dsrun.accelerator.abstract_accelerator import DeepSpeedAccelerator
from dsrun.utils.errors import ConfigError, Problem

logger = logging.getLogger("DeepSpeed")

SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu"]

# the package each family's torch module comes from, where torch does not ship it
_PACKAGES = {"npu": "torch_npu", "sdaa": "torch_sdaa", "hpu": "habana_frameworks.torch.hpu", "mlu": "torch_mlu",
             "supa": "torch_supa", "klxpu": "torch_xmlir"}

ds_accelerator: DeepSpeedAccelerator | None = None  # DeepSpeed's name for the process's accelerator


def _importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def _mps_present() -> bool:
    try:
        torch.mps.current_allocated_memory()  # raises without the MPS backend (DeepSpeed's probe)
    except (RuntimeError, AttributeError):
        return False
    return True


def _refuse(message: str) -> ConfigError:
    """A user's error (one line, exit code 2) that is also the ValueError DeepSpeed raises here."""
    return ConfigError(Problem("DS_ACCELERATOR", message, "unset it to detect the device, or name another family"))


def _check_present(name: str) -> None:
    """Refuse a named family that cannot run in this installation, as DeepSpeed does."""
    if name == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise _refuse("XPU_Accelerator requires PyTorch with XPU support (torch.xpu), and no XPU is available")
    if name == "mps" and not _mps_present():
        raise _refuse("MPS_Accelerator requires torch.mps, which is not installed on this system")
    if name in _PACKAGES and not _importable(_PACKAGES[name]):
        raise _refuse(f"{name.upper()}_Accelerator requires {_PACKAGES[name]}, which is not installed on this system")


def _detect() -> str:
    """DeepSpeed's order of detection; the CPU when no device family is present."""
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    for name in ("npu", "sdaa"):
        if importlib.util.find_spec(_PACKAGES[name]) is not None and _importable(_PACKAGES[name]):
            return name
    if _mps_present():
        return "mps"
    for name in ("hpu", "mlu"):
        if importlib.util.find_spec(_PACKAGES[name].split(".")[0]) is not None and _importable(_PACKAGES[name]):
            return name
    if importlib.util.find_spec("torch_supa") is not None and _importable("torch_supa") \
            and hasattr(torch, "supa") and torch.supa.is_available():
        return "supa"
    if importlib.util.find_spec("torch_xmlir") is not None and _importable("torch_xmlir"):
        return "klxpu"  # presents itself through torch.cuda: asked before CUDA
    if torch.cuda.device_count() > 0 and torch.cuda.is_available():
        return "cuda"
    # DeepSpeed warns here; on dsrun the CPU is an ordinary choice, so the line is for debugging only
    logger.debug("Setting accelerator to CPU: no GPU or other accelerator was detected")
    return "cpu"


def accelerator_class(name: str) -> type[DeepSpeedAccelerator]:
    """The class of the family ``name`` (``"cuda"`` -> ``CUDA_Accelerator``)."""
    if name not in SUPPORTED_ACCELERATOR_LIST:
        raise _refuse(f'must be one of {SUPPORTED_ACCELERATOR_LIST}; value "{name}" is not supported')
    module = importlib.import_module(f"dsrun.accelerator.{name}_accelerator")
    return getattr(module, f"{name.upper()}_Accelerator")


def _wanted() -> str | None:
    named = {key: os.environ[key].strip().lower() for key in ("DS_ACCELERATOR", "DSRUN_ACCELERATOR")
             if os.environ.get(key, "").strip()}
    if len(set(named.values())) > 1:
        raise _refuse(f"{named['DS_ACCELERATOR']!r} and DSRUN_ACCELERATOR={named['DSRUN_ACCELERATOR']!r} "
                      f"disagree; set one of them")
    return next(iter(named.values()), None)


def get_accelerator() -> DeepSpeedAccelerator:
    """The accelerator for this process: the one set, else the one ``DS_ACCELERATOR`` names, else detected."""
    global ds_accelerator
    if ds_accelerator is None:
        name = _wanted()
        if name is not None:
            accelerator_class(name)  # an unknown name is refused before its package is looked for
            _check_present(name)
            how = "override"
        else:
            name, how = _detect(), "auto detect"
        ds_accelerator = accelerator_class(name)()
        logger.debug(f"Setting ds_accelerator to {ds_accelerator._name} ({how})")
    return ds_accelerator


def set_accelerator(accelerator: DeepSpeedAccelerator | str) -> None:
    """Use ``accelerator`` from now on (an instance, or a family's name); AssertionError, as DeepSpeed's, for an
    object that is not a ``DeepSpeedAccelerator``."""
    global ds_accelerator
    if isinstance(accelerator, str):
        accelerator = accelerator_class(accelerator)()
    if not isinstance(accelerator, DeepSpeedAccelerator):
        raise AssertionError(f"{type(accelerator).__name__} accelerator is not subclass of DeepSpeedAccelerator")
    ds_accelerator = accelerator


def is_current_accelerator_supported() -> bool:
    """Whether the process's accelerator is one of DeepSpeed's families."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
