"""``deepspeed.module_inject.auto_tp``: DeepSpeed's ``AutoTP`` driver class (home:
:mod:`dsrun.tensor_parallel.deepspeed_autotp`)."""
from dsrun.tensor_parallel.deepspeed_autotp import AutoTP

__all__ = ["AutoTP"]
