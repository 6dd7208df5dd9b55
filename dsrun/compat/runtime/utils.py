"""``deepspeed.runtime.utils``: the helpers client scripts and tests call, ``set_random_seed`` (home:
:mod:`dsrun.utils.seeding`), ``see_memory_usage`` (home: :mod:`dsrun.profiling.memory_usage`) and the pipeline's
layer partitioning, ``partition_uniform(num_items, num_parts)`` and ``partition_balanced(weights, num_parts)``
(home: :mod:`dsrun.pipe.partition`; the same cuts as DeepSpeed's, as lists of ints), and
``is_model_parallel_parameter`` (home: :mod:`dsrun.tensor_parallel.layers`)."""
from dsrun.pipe.partition import partition_balanced, partition_uniform
from dsrun.profiling.memory_usage import see_memory_usage
from dsrun.tensor_parallel.layers import is_model_parallel_parameter
from dsrun.utils.seeding import set_random_seed

__all__ = ["is_model_parallel_parameter", "partition_balanced", "partition_uniform", "see_memory_usage",
           "set_random_seed"]
