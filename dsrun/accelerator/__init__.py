"""The accelerator layer, DeepSpeed's ``deepspeed.accelerator``: which device, which communication backend,
whether to pin host memory.

One object answers the device questions the rest of dsrun would otherwise branch on (CPU ranks talk over gloo,
CUDA ranks over NCCL, only a device benefits from pinned host buffers); everything else in the engine is written
once against it. ``abstract_accelerator.DeepSpeedAccelerator`` is the interface, ``device.Accelerator`` answers
it from a torch device module, and each ``<family>_accelerator.py`` is one of DeepSpeed's classes
(``CPU_Accelerator``, ``CUDA_Accelerator``, ``XPU_Accelerator``, ...); ``real_accelerator`` picks one
(``DS_ACCELERATOR``, else detection) as DeepSpeed does.
"""
from __future__ import annotations

from dsrun.accelerator.abstract_accelerator import DeepSpeedAccelerator
from dsrun.accelerator.device import Accelerator
from dsrun.accelerator.real_accelerator import (SUPPORTED_ACCELERATOR_LIST, get_accelerator,
                                                is_current_accelerator_supported, set_accelerator)

__all__ = ["SUPPORTED_ACCELERATOR_LIST", "Accelerator", "DeepSpeedAccelerator", "get_accelerator",
           "is_current_accelerator_supported", "set_accelerator"]
