"""``see_memory_usage``: a labelled line of device and host memory (DeepSpeed's ``deepspeed.runtime.utils`` helper)."""
from __future__ import annotations

import gc

from dsrun.accelerator import get_accelerator


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
