"""``deepspeed.runtime.tensor_parallel``: AutoTP training's config helpers (home: :mod:`dsrun.tensor_parallel`)."""
from . import config

__all__ = ["config"]
