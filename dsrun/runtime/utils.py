"""``deepspeed.runtime.utils`` helpers client scripts call: ``set_random_seed`` and ``see_memory_usage``."""
from __future__ import annotations

import gc
import random

import numpy as np
import torch

from dsrun.accelerator import get_accelerator


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy and torch (every device) with ``seed``: the same seed on every rank gives
    identical initial weights without a broadcast and reproducible dropout."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with the accelerator's allocated memory and this process's host memory, on rank 0.

    As in DeepSpeed it does nothing unless ``force`` is true (callers leave the calls in and switch them on).
    """
    if not force:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    import psutil

    from dsrun.utils.logging import logger

    gc.collect()
    accelerator = get_accelerator()
    gib = 2 ** 30
    virtual = psutil.virtual_memory()
    logger.info(message)
    logger.info(f"MA {accelerator.memory_allocated() / gib:.2f} GB "
                f"Max_MA {accelerator.max_memory_allocated() / gib:.2f} GB")
    logger.info(f"CPU Virtual Memory:  used = {(virtual.total - virtual.available) / gib:.2f} GB, "
                f"percent = {virtual.percent}%")
    accelerator.reset_peak_memory_stats()
