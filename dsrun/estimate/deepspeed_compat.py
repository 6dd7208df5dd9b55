"""DeepSpeed's model-state memory estimators, with DeepSpeed's names, signatures and printed tables.

These are the four functions of the DeepSpeed 0.14.1 "Memory Requirements" chapter
(``estimate_zero2_model_states_mem_needs_all_live/_cold`` and ``estimate_zero3_...``): they print a table of
the memory needed for parameters, gradients and Adam states, and return None. A script that imported them
from ``deepspeed.runtime.zero.stage_1_and_2`` / ``deepspeed.runtime.zero.stage3`` switches by importing them
from :mod:`dsrun.estimate` instead.

The arithmetic follows the documentation's "Discussion" section, with one documented exception taken from
the 0.14.1 code: the ZeRO-2 CPU estimate with optimizer offload uses ``max(4 * total_gpus, 16)`` (the doc
says GPUs per node; the two differ only with more than one node). Later DeepSpeed releases changed the
ZeRO-2 formula and print enum names such as ``OffloadDeviceEnum.cpu``; we keep the documented output, with
the offload device written as ``cpu `` (padded to four characters) or ``none``.

The helpers ``format_zero2_table`` / ``format_zero3_table`` return the printed text, so the CLI can show
the same tables and tests can compare them byte for byte.
"""
from __future__ import annotations

import torch

from dsrun.estimate.counting import count_parameters

GIB = 2**30

_TITLE = "Estimated memory needed for params, optim states and gradients for a:"
_HEADER = "  per CPU  |  per GPU |   Options"


def _device_word(offloaded: bool) -> str:
    # DeepSpeed formats the device enum to width 4, so "cpu" carries a trailing space and "none" fills it.
    return "cpu " if offloaded else "none"


def _hardware_line(num_gpus_per_node: int, num_nodes: int) -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node."


def _row(cpu_mem: float, gpu_mem: float, options: str) -> str:
    return f" {cpu_mem / GIB:7.2f}GB | {gpu_mem / GIB:6.2f}GB | {options}"


def estimate_zero2_model_states_mem_needs(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """Bytes of (CPU, GPU) memory per node/GPU that ZeRO-2 needs for model states.

    GPU: ``2*params`` with the optimizer offloaded to CPU (fp16 params only), else
    ``4*params + int(16*params/total_gpus)`` (fp16 params and grads, plus the partition of fp32 params,
    grads, momentum and variance). CPU: ``params*max(4*total_gpus, 16)*factor`` with offload, else
    ``params*4*num_gpus_per_node*factor`` (each process creates the model in fp32 at init).
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params: float, largest_layer_params: float,
                                          num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """Bytes of (CPU, GPU, largest-layer) memory that ZeRO-3 needs for model states.

    ``largest_layer_memory = 4*largest_layer_params`` (fp16 params gathered plus their fp16 grads).
    GPU: params and optimizer offloaded -> the largest layer only; optimizer offloaded ->
    ``+ int(2*params/total_gpus)``; nothing offloaded -> ``+ int(18*params/total_gpus)``.
    CPU (``gpus_factor = 1/num_nodes``): with zero.Init the partitioned fp32 states (18 or 16 bytes per
    parameter, or only the largest layer in fp32 per process without offload); without zero.Init each
    process first builds the whole model in fp32 (``4*num_gpus_per_node`` bytes per parameter).
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params

    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)


def format_zero2_table(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                       additional_buffer_factor: float = 1.5) -> str:
    """The text ``estimate_zero2_model_states_mem_needs_all_cold`` prints (with a final newline)."""
    lines = [_TITLE, _hardware_line(num_gpus_per_node, num_nodes),
             f"SW: Model with {int(total_params / 1e6)}M total params.", _HEADER]
    for cpu_offload in (True, False):
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor)
        lines.append(_row(cpu_mem, gpu_mem, f"offload_optimizer={_device_word(cpu_offload)}"))
    return "\n".join(lines) + "\n"


def format_zero3_table(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                       num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """The text ``estimate_zero3_model_states_mem_needs_all_cold`` prints (with a final newline)."""
    lines = [_TITLE, _hardware_line(num_gpus_per_node, num_nodes),
             f"SW: Model with {int(total_params / 1e6)}M total params, "
             f"{int(largest_layer_params / 1e6)}M largest layer params.", _HEADER]
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            # Offloading parameters without offloading the optimizer is not a supported combination.
            if not cpu_offload and cpu_offload_params:
                continue
            for zero_init in (True, False):
                cpu_mem, gpu_mem, _ = estimate_zero3_model_states_mem_needs(
                    total_params, largest_layer_params, num_gpus_per_node, num_nodes, cpu_offload,
                    cpu_offload_params, zero_init, additional_buffer_factor)
                options = (f"offload_param={_device_word(cpu_offload_params)}, "
                           f"offload_optimizer={_device_word(cpu_offload)}, zero_init={int(zero_init)}")
                lines.append(_row(cpu_mem, gpu_mem, options))
    return "\n".join(lines) + "\n"


def estimate_zero2_model_states_mem_needs_all_cold(total_params: float, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 model-state memory needs for a model of ``total_params`` parameters.

    Use this for a hypothetical model; with a model object use
    :func:`estimate_zero2_model_states_mem_needs_all_live`, which counts the parameters itself.
    """
    print(format_zero2_table(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor), end="")


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-2 model-state memory needs for ``model`` (shared parameters counted once).

    The model may live on the meta device, so a model of any size can be estimated without its weights.
    """
    counts = count_parameters(model)
    estimate_zero2_model_states_mem_needs_all_cold(counts.total, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: float, largest_layer_params: float,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 model-state memory needs for ``total_params`` and ``largest_layer_params``.

    Use this for a hypothetical model; with a model object use
    :func:`estimate_zero3_model_states_mem_needs_all_live`.
    """
    print(format_zero3_table(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                             additional_buffer_factor), end="")


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print the ZeRO-3 model-state memory needs for ``model``: total parameters (shared ones once) and the
    largest layer (the module with the most parameters of its own)."""
    counts = count_parameters(model)
    estimate_zero3_model_states_mem_needs_all_cold(counts.total, counts.largest_layer, num_gpus_per_node,
                                                   num_nodes, additional_buffer_factor)
