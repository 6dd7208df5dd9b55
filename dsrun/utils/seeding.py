"""One seed function for every rank and every RNG (DeepSpeed's ``deepspeed.runtime.utils.set_random_seed``)."""
from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy and torch (every device) with ``seed``: the same seed on every rank gives
    identical initial weights without a broadcast and reproducible dropout."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
