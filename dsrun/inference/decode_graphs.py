"""``deepspeed.runtime.hybrid_engine_graph``: CUDA-graph replay of the single-token forwards of a generation.

A decode step is one small forward whose cost is mostly kernel launches; replaying it from a CUDA graph makes it
one launch. A graph freezes the sequence position its kernels write to, so there is one graph per decode
position, captured on the first sequence of a given length and replayed by the next ones of that length.
DeepSpeed's v1 kernels advance their sequence counter on the host, which a replay does not, so a sequence runs
either wholly from graphs or wholly eagerly: :meth:`DecodeGraphCache.begin_sequence` decides before its first step,
from the length a ``generate`` call pins (:func:`decode_steps_from_generate_kwargs`). A capture that fails (on a
CPU there are no graphs) or inputs whose shapes change turn the cache off for good and run eagerly, with one warning.
:func:`validate_cuda_graph_support` says why a hybrid-engine configuration cannot use graphs.

The hybrid engine (:mod:`dsrun.hybrid_engine`, ``hybrid_engine.enable_cuda_graph``) wraps its module's forward with
it while generating; a caller can wrap its own generation forward the same way.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch

from dsrun.accelerator import get_accelerator
from dsrun.utils.logging import logger


class HybridEngineSettings(Protocol):
    """The two settings of DeepSpeed's ``hybrid_engine`` section that decide whether graphs can be used."""

    release_inference_cache: bool
    inference_tp_size: int


def _tensor_kwargs(kwargs: Mapping[str, Any]) -> list[str]:
    return [name for name, value in kwargs.items() if torch.is_tensor(value)]


class DecodeGraphCache:
    """Runs ``forward`` for a generation, each single-token forward of a pinned-length sequence from the graph
    captured for its position (at most ``max_positions`` graphs, which bounds their memory)."""

    def __init__(self, forward: Callable[..., Any], max_positions: int):
        self._forward, self._max_positions = forward, max_positions
        self._graphs: dict[int, Any] = {}
        self._static_kwargs: dict[int, dict[str, torch.Tensor]] = {}
        self._static_outputs: dict[int, Any] = {}
        self._pool: Any = None
        self._position = 0
        self._captured_length: int | None = None
        self._use_graphs = False
        self._disabled = False

    @property
    def captured_positions(self) -> int:
        return len(self._graphs)

    def invalidate(self) -> None:
        """Drop every graph, their inputs and outputs, and the memory pool behind them."""
        self._graphs.clear()
        self._static_kwargs.clear()
        self._static_outputs.clear()
        self._pool, self._captured_length = None, None

    def begin_sequence(self, num_decode_steps: int | None) -> None:
        """Before a sequence: graphs for its ``num_decode_steps`` single-token forwards when that is known, positive
        and within ``max_positions``; eager otherwise. Another length than the captured one recaptures."""
        self._position = 0
        if self._disabled or num_decode_steps is None or not 0 < num_decode_steps <= self._max_positions:
            self._use_graphs = False
            return
        if self._captured_length is not None and self._captured_length != num_decode_steps:
            logger.info(f"decode graphs: generation length {self._captured_length} -> {num_decode_steps}, "
                        "recapturing")
            self.invalidate()
        self._captured_length, self._use_graphs = num_decode_steps, True

    def _capture(self, position: int, args: tuple, kwargs: dict[str, Any]) -> None:
        accelerator = get_accelerator()
        graph = accelerator.create_graph()
        static = {name: kwargs[name].clone() for name in _tensor_kwargs(kwargs)}
        with accelerator.capture_to_graph(graph, pool=self._pool):
            output = self._forward(*args, **{**kwargs, **static})
        if self._pool is None:
            self._pool = graph.pool()  # later graphs share the first one's memory pool
        self._graphs[position], self._static_kwargs[position], self._static_outputs[position] = graph, static, output

    def _replay(self, position: int, kwargs: Mapping[str, Any]) -> Any:
        for name, buffer in self._static_kwargs[position].items():
            buffer.copy_(kwargs[name])
        get_accelerator().replay_graph(self._graphs[position])
        return self._static_outputs[position]

    def _shapes_match(self, position: int, kwargs: Mapping[str, Any]) -> bool:
        captured = self._static_kwargs[position]
        return set(captured) == set(_tensor_kwargs(kwargs)) and all(
            captured[name].shape == kwargs[name].shape for name in captured)

    def _fall_back(self, reason: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Turn graphs off for good and run eagerly (reached only before this sequence replayed anything)."""
        logger.warning(f"decode graphs disabled: {reason}")
        self.invalidate()
        self._disabled, self._use_graphs = True, False
        return self._forward(*args, **kwargs)

    def __call__(self, *args: object, **kwargs: object) -> Any:
        input_ids = kwargs.get("input_ids")
        decode_step = input_ids is not None and input_ids.dim() == 2 and input_ids.shape[1] == 1
        if not self._use_graphs or not decode_step:
            return self._forward(*args, **kwargs)  # the prompt, or an eager sequence
        position = self._position
        self._position += 1
        if position >= self._max_positions:  # longer than declared: replays ran, eager would be out of step
            raise RuntimeError(f"decode graphs: the generation ran past its declared length ({self._max_positions} "
                               "decode steps); raise hybrid_engine.max_out_tokens or disable "
                               "hybrid_engine.enable_cuda_graph")
        if position in self._graphs:
            if self._shapes_match(position, kwargs):
                return self._replay(position, kwargs)
            return self._fall_back("input shapes changed mid-sequence", args, kwargs)
        try:
            self._capture(position, args, kwargs)
        except Exception as err:  # noqa: BLE001 - any capture failure means: run this sequence eagerly
            return self._fall_back(f"capture failed at position {position}: {err}", args, kwargs)
        return self._replay(position, kwargs)  # a capture records without running: the first run is a replay


def decode_steps_from_generate_kwargs(kwargs: Mapping[str, Any]) -> int | None:
    """The single-token forwards of a Hugging Face ``generate`` call when its length is pinned
    (``max_new_tokens == min_new_tokens``: the prompt's forward gives the first token, one forward each the
    rest); None for an open-ended length, which may stop early or outrun its graphs."""
    max_new, min_new = kwargs.get("max_new_tokens"), kwargs.get("min_new_tokens")
    if max_new is None or min_new is None or max_new != min_new:
        return None
    return int(max_new) - 1


def validate_cuda_graph_support(config: HybridEngineSettings, zero_stage: int) -> str | None:
    """Why a hybrid-engine configuration (``release_inference_cache``, ``inference_tp_size``) at ``zero_stage``
    cannot replay decode graphs, or None when it can."""
    accelerator = get_accelerator()
    if not accelerator.is_available() or accelerator.device_name() != "cuda":
        return "CUDA graphs require the CUDA accelerator"
    if zero_stage == 3:  # the gathered weights are fresh buffers each generate; a graph keeps reading the old ones
        return "CUDA graphs are not supported with ZeRO stage 3"
    if config.release_inference_cache:  # it frees the buffers the graphs write into
        return "CUDA graphs are not supported with release_inference_cache"
    if config.inference_tp_size > 1:
        return "CUDA graphs are not supported with inference_tp_size > 1"
    return None
