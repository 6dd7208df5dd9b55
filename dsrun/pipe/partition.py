"""How a PipelineModule's layers are cut into stages: ``partition_method`` and the algorithms behind it.

``uniform``       the same number of layers per stage (the first stages take one more when it does not divide);
``parameters``    balance the trainable parameter counts (DeepSpeed's default);
``type:REGEX``    balance the layers whose class name matches REGEX (case-insensitive), e.g. ``type:block``;
``profile``       balance the measured forward + backward time of each layer on an example micro-batch
                  (DeepSpeed lists it but never implemented it). The example is what the first layer
                  receives; give it by building the module inside ``with profiling_inputs(example):``.

Balanced cuts minimise the heaviest stage (the pipeline's bottleneck), each stage non-empty when there are
at least as many layers as stages. The result is a list of ``num_parts + 1`` boundaries: stage ``s`` holds
layers ``[parts[s], parts[s + 1])``.
"""
from __future__ import annotations

import contextlib
import re
import statistics
import time
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from dsrun import comm
from dsrun.utils.errors import Problem, UserError
from dsrun.zero.tiling import partition_uniform  # DeepSpeed keeps one partition_uniform for both

from dsrun.pipe.spec import Activations, LayerSpec, PipeLayer, TiedLayerSpec

PROFILE_REPEATS = 5
_EXAMPLE: list[Activations] = []  # the example micro-batch of the innermost profiling_inputs() block


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts minimising the largest part's total weight (every part
    non-empty when there are enough items; ties go to the earliest cut)."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: the smallest bottleneck of cutting the first i items into k non-empty parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    parts = [n]
    for k in range(num_parts, 0, -1):
        parts.append(cut[k][parts[-1]])
    return parts[::-1]


def layer_class_name(layer: PipeLayer) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__


def count_layer_params(layer: PipeLayer) -> int:
    """Trainable parameters of one layer; a spec is built on the meta device to count them (no memory)."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                module = layer.build()
        except Exception:  # a layer whose constructor needs real tensors: build it for real, once
            module = layer.build()
    else:
        module = layer
    if not isinstance(module, nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def layer_weights(layers: Sequence[PipeLayer], method: str) -> list[float] | None:
    """Per-layer weights for a balanced method, or None for ``uniform``; a clear error for an unknown one."""
    name = method.lower()
    if name == "uniform":
        return None
    if name == "parameters":
        return [float(count_layer_params(layer)) for layer in layers]
    if name.startswith("type:"):
        pattern = re.compile(method[len("type:"):], re.IGNORECASE)
        weights = [1.0 if pattern.search(layer_class_name(layer)) else 0.0 for layer in layers]
        if not any(weights):
            raise UserError(Problem("PipelineModule(partition_method=...)", f"{method!r} matches no layer "
                                    f"(layer classes: {sorted({layer_class_name(x) for x in layers})})",
                                    "use a regular expression matching some of these class names"))
        return weights
    if name == "profile":
        return profile_layer_times(layers)
    raise UserError(Problem("PipelineModule(partition_method=...)", f"got {method!r}; allowed: 'parameters', "
                            "'uniform', 'type:REGEX', 'profile'"))


def partition_layers(layers: Sequence[PipeLayer], num_parts: int, method: str) -> list[int]:
    weights = layer_weights(layers, method)
    if weights is None:
        return partition_uniform(len(layers), num_parts)
    return partition_balanced(weights, num_parts)


# --- profile ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def profiling_inputs(example: Activations) -> Iterator[None]:
    """Inside this block, ``PipelineModule(..., partition_method='profile')`` times its layers on
    ``example``, one micro-batch as the first layer receives it (every rank passes one; rank 0's is used)."""
    _EXAMPLE.append(example)
    try:
        yield
    finally:
        _EXAMPLE.pop()


def _floats(value: Activations) -> list[torch.Tensor]:
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in items if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad]


def _detached(value: Activations) -> Activations:
    def one(t: object) -> object:
        if torch.is_tensor(t):
            t = t.detach()
            return t.requires_grad_(True) if t.is_floating_point() else t
        return t

    return tuple(one(t) for t in value) if isinstance(value, tuple) else one(value)


def _time_layer(fn: Callable[[Activations], Activations], x: Activations) -> tuple[float, Activations]:
    """Median seconds of one forward + backward of ``fn`` on ``x`` (after one warm-up), and its output."""
    times, out = [], None
    for repeat in range(PROFILE_REPEATS + 1):
        inputs = _detached(x)
        start = time.perf_counter()
        out = fn(inputs)
        floats = _floats(out)
        if floats:
            torch.autograd.backward(floats, [torch.ones_like(t) for t in floats])
        if repeat:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out


def profile_layer_times(layers: Sequence[PipeLayer]) -> list[float]:
    """Forward + backward seconds of every layer on the example micro-batch, measured on global rank 0 (the
    others receive rank 0's figures, so every rank cuts the model the same way). The layers are built and
    run with the random number generators forked, so the model built afterwards is the same as without."""
    if not _EXAMPLE:
        raise UserError(Problem("PipelineModule(partition_method='profile')", "no example micro-batch to time the "
                                "layers on", "build the module inside `with dsrun.pipe.profiling_inputs(batch_inputs):`"))
    result: list[Any] = [None]
    if comm.get_rank() == 0:
        with torch.random.fork_rng(devices=[]):
            x, times, tied = _EXAMPLE[-1], [], {}
            for layer in layers:
                if isinstance(layer, TiedLayerSpec):
                    module = tied.setdefault(layer.key, layer.build())
                    fn = (lambda m, f: (lambda inputs: f(m, inputs)))(module, layer.forward_fn) if layer.forward_fn else module
                else:
                    fn = layer.build() if isinstance(layer, LayerSpec) else layer
                seconds, x = _time_layer(fn, x)
                times.append(seconds)
        result[0] = times
    if comm.is_initialized() and comm.get_world_size() > 1:
        comm.broadcast_object_list(result, src=0)
    return [float(t) for t in result[0]]
