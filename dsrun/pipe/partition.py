"""How a PipelineModule's layers are cut into stages: ``partition_method`` and the algorithms behind it.

The method name is case-insensitive, as in DeepSpeed (``"Parameters"``, ``"TYPE:Block"``); the cuts are
DeepSpeed's, layer for layer (``benchmarks/pipeline_example.py`` checks them against DeepSpeed 0.19.8):

``uniform``       the same number of layers per stage (the first stages take one more when it does not divide);
``parameters``    balance the trainable parameter counts (DeepSpeed's default); a layer that is neither a module
                  nor a ``LayerSpec`` (a function, a lambda) weighs nothing;
``type:REGEX``    balance the number of layers whose class name matches REGEX (searched, case-insensitive; as
                  DeepSpeed does, the lower-cased text between the first and the second ``:``); a function layer
                  is matched by its ``__name__``;
``profile``       balance the measured forward + backward time of each layer on an example micro-batch
                  (DeepSpeed lists it but never implemented it). The example is what the first layer
                  receives; give it by building the module inside ``with profiling_inputs(example):``.

Balanced cuts are DeepSpeed's ``partition_balanced``: contiguous non-empty stages (when there are at least as
many layers as stages) whose weights differ as little as possible, heaviest minus lightest, and among equal
differences the cut found last (each stage boundary as late as it can be). The result is a list of
``num_parts + 1`` boundaries: stage ``s`` holds layers ``[parts[s], parts[s + 1])``.
"""
from __future__ import annotations

import contextlib
import numbers
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


class PartitionError(UserError, RuntimeError):
    """A ``type:`` method matching no layer (DeepSpeed raises RuntimeError there)."""


class UnknownPartitionMethod(UserError, NotImplementedError):
    """A ``partition_method`` neither DeepSpeed nor dsrun has (DeepSpeed raises NotImplementedError)."""


def _prefix_sums(weights: Sequence[float]) -> list[float]:
    """Running totals as DeepSpeed's ``numpy.cumsum`` makes them: integer weights summed exactly, then made
    floats; otherwise added one after the other in double precision."""
    sums: list[float] = [0.0]
    if all(isinstance(w, numbers.Integral) for w in weights):
        total = 0
        for w in weights:
            total += int(w)
            sums.append(float(total))
        return sums
    running = 0.0
    for w in weights:
        running += float(w)
        sums.append(running)
    return sums


def prefix_sum_inc(weights: Sequence[float]) -> list[float]:
    """The inclusive running totals of ``weights`` (``[3, 4, 5]`` -> ``[3, 7, 12]``), in the weights' own type
    (DeepSpeed's helper; :func:`partition_balanced` keeps its own, numpy-like sums)."""
    sums: list[float] = []
    for w in weights:
        sums.append(w if not sums else sums[-1] + w)
    return sums


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: the ``num_parts + 1`` boundaries of contiguous, non-empty parts of
    ``weights`` (``partition_uniform`` when there are no more items than parts) whose totals differ the
    least, heaviest minus lightest.

    DeepSpeed's dynamic programme (its variant of the linear partition problem): ``spread[i][j]`` is the
    spread (heaviest - lightest) of the cut chosen for the first ``i`` items into ``j`` parts, found by adding
    a last part ``(k, i]`` to the cut chosen for the first ``k`` items, for each ``k`` in increasing order; a
    ``k`` whose spread equals the best so far replaces it, so among equal spreads each boundary is as late as
    it can be (``partition_balanced([0, 0, 0, 9], 2) == [0, 3, 4]``). Like DeepSpeed's, it extends only the
    chosen cut of each prefix, which is not always the least spread over all cuts.
    """
    n, m = len(weights), int(num_parts)
    if n <= m:
        return partition_uniform(n, m)
    prefix = _prefix_sums(weights)
    inf = float("inf")
    # heaviest, lightest part and spread of the best cut of the first i items into j parts; inf: none yet
    heaviest = [[inf] * (m + 1) for _ in range(n + 1)]
    lightest = [[inf] * (m + 1) for _ in range(n + 1)]
    spread = [[inf] * (m + 1) for _ in range(n + 1)]
    last_cut = [[0] * (m + 1) for _ in range(n + 1)]
    heaviest[0][0] = spread[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                if heaviest[k][j - 1] == inf:  # k items cannot make j - 1 parts: never chosen by DeepSpeed either
                    continue
                part = prefix[i] - prefix[k]
                high = max(heaviest[k][j - 1], part)
                low = min(lightest[k][j - 1], part)
                if spread[i][j] >= high - low:
                    spread[i][j], heaviest[i][j], lightest[i][j], last_cut[i][j] = high - low, high, low, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(last_cut[parts[-1]][j])
    return parts[::-1]


def layer_type_name(layer: PipeLayer) -> str | None:
    """The name a ``type:`` regex is matched against (DeepSpeed's ``_find_layer_type``): a spec's class, a
    module's class, a function's ``__name__``; None for an object with none of these (it never matches)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    name = getattr(layer, "__name__", None)
    return name if isinstance(name, str) else None


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
        regex = name.split(":")[1]  # DeepSpeed's reading: lower-cased, up to a second ':'
        pattern = re.compile(regex, re.IGNORECASE)
        names = [layer_type_name(layer) for layer in layers]
        weights = [1.0 if n is not None and pattern.search(n) else 0.0 for n in names]
        if not any(weights):
            raise PartitionError(Problem("PipelineModule(partition_method=...)", f"{method!r} matches no layer "
                                         f"(layer names: {sorted({n for n in names if n is not None})})",
                                         "use a regular expression matching some of these names"))
        return weights
    if name == "profile":
        return profile_layer_times(layers)
    raise UnknownPartitionMethod(Problem("PipelineModule(partition_method=...)", f"got {method!r}; allowed: "
                                         "'parameters', 'uniform', 'type:REGEX', 'profile' (any case)"))


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
