"""``deepspeed.utils.timer``: ``trim_mean``, the trimmed mean the comms logger summarises latencies with (home:
:mod:`dsrun.comm.logger`; it cuts ``int(n * proportion)`` values from each end, DeepSpeed ``round(...)``)."""
from dsrun.comm.logger import trim_mean

__all__ = ["trim_mean"]
