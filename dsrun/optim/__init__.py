"""Optimizers: the registry by DeepSpeed name and the torch implementations dsrun adds (Lamb, Lion, Adam
with DeepSpeed's options)."""
from .adam import Adam
from .lamb import Lamb
from .lion import Lion
from .registry import (build_optimizer, check_zero_optimizer, compiled_cpu_adam, is_zero_supported_optimizer)

__all__ = ["Adam", "Lamb", "Lion", "build_optimizer", "check_zero_optimizer", "compiled_cpu_adam",
           "is_zero_supported_optimizer"]
