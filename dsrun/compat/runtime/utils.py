"""``deepspeed.runtime.utils``: the helpers client scripts call, ``set_random_seed`` (home:
:mod:`dsrun.utils.seeding`) and ``see_memory_usage`` (home: :mod:`dsrun.profiling.memory_usage`)."""
from dsrun.profiling.memory_usage import see_memory_usage
from dsrun.utils.seeding import set_random_seed

__all__ = ["see_memory_usage", "set_random_seed"]
