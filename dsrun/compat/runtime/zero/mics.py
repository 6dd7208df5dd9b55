"""``deepspeed.runtime.zero.mics``: ``MiCS_Init`` (its home is :mod:`dsrun.zero.init`; the MiCS training itself is
the ZeRO++/MiCS feature, :mod:`dsrun.zero.zeropp`)."""
from dsrun.zero.init import MiCS_Init

__all__ = ["MiCS_Init"]
