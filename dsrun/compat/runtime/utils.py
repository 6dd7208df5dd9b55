"""``deepspeed.runtime.utils``: the helpers client scripts and tests call, ``set_random_seed`` (home:
:mod:`dsrun.utils.seeding`), ``see_memory_usage`` (home: :mod:`dsrun.profiling.memory_usage`), the pipeline's
layer partitioning, ``partition_uniform(num_items, num_parts)``, ``partition_balanced(weights, num_parts)`` and
``prefix_sum_inc`` (home: :mod:`dsrun.pipe.partition`; the same cuts as DeepSpeed's, as lists of ints),
``PartitionedTensor`` (home: :mod:`dsrun.pipe.partitioned_tensor`), ``call_to_str`` (home:
:mod:`dsrun.utils.logging`), ``is_model_parallel_parameter`` (home: :mod:`dsrun.tensor_parallel.layers`) and the
gradient helpers ``clip_grad_norm_``, ``get_weight_norm``, ``CheckOverflow``, ``count_used_parameters_in_backward``
(home: :mod:`dsrun.tensor_parallel.megatron_grads`), ``register_output_backward_hooks`` and
``OutputBackwardHookManager`` (home: :mod:`dsrun.engine.output_hooks`), ``move_to_device`` (home:
:mod:`dsrun.utils.init_on_device`)."""
from dsrun.engine.output_hooks import OutputBackwardHookManager, register_output_backward_hooks
from dsrun.pipe.partition import partition_balanced, partition_uniform, prefix_sum_inc
from dsrun.pipe.partitioned_tensor import PartitionedTensor
from dsrun.profiling.memory_usage import see_memory_usage
from dsrun.tensor_parallel.layers import is_model_parallel_parameter
from dsrun.tensor_parallel.megatron_grads import CheckOverflow, clip_grad_norm_, count_used_parameters_in_backward, get_weight_norm
from dsrun.utils.init_on_device import move_to_device
from dsrun.utils.logging import call_to_str
from dsrun.utils.seeding import set_random_seed

__all__ = ["CheckOverflow", "OutputBackwardHookManager", "register_output_backward_hooks", "PartitionedTensor", "call_to_str", "clip_grad_norm_", "count_used_parameters_in_backward",
           "get_weight_norm", "is_model_parallel_parameter", "move_to_device", "partition_balanced", "partition_uniform",
           "prefix_sum_inc", "see_memory_usage", "set_random_seed"]
