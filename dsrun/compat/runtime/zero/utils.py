"""``deepspeed.runtime.zero.utils``: ``ZeRORuntimeException`` (home: :mod:`dsrun.utils.errors`; dsrun raises it where
DeepSpeed's ZeRO does at ``initialize``: an offloaded client optimizer that is not a DeepSpeed CPU optimizer)."""
from dsrun.utils.errors import ZeRORuntimeException

__all__ = ["ZeRORuntimeException"]
