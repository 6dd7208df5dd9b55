"""``deepspeed.inference.v2.modules.implementations``: importing it registers the implementations."""
from . import linear
from .linear import QuantizedWf6Af16Linear

__all__ = ["QuantizedWf6Af16Linear", "linear"]
