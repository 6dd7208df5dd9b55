"""``deepspeed.ops.lamb``: DeepSpeed's ``FusedLamb``, which is dsrun's LAMB (:mod:`dsrun.optim.lamb`: the same
keywords and per-parameter trust ratio, on CPU tensors as on the accelerator's)."""
from __future__ import annotations

from dsrun.optim.lamb import Lamb


class FusedLamb(Lamb):
    """DeepSpeed's name for LAMB (``deepspeed.ops.lamb.FusedLamb``); ZeRO accepts it as a tested optimizer."""


__all__ = ["FusedLamb"]
