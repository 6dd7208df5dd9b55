"""DeepSpeed's ``runtime.hybrid_engine``: ``DeepSpeedHybridEngine``, the engine :func:`dsrun.initialize` returns
with ``hybrid_engine.enabled`` (DeepSpeed-Chat's actor). It trains as :class:`DeepSpeedEngine` does; its
``generate`` (also bound as ``engine.module.generate``) is the hybrid-engine feature's (:mod:`dsrun.hybrid_engine`:
the ZeRO-3 gather, the tensor-parallel split, the inference workspace), and ``eval()`` logs DeepSpeed's latency
line on rank 0 (docs/hybrid_engine.md)."""
from __future__ import annotations

import time
from typing import Any

import torch

from dsrun import comm
from dsrun.engine.engine import DeepSpeedEngine
from dsrun.hybrid_engine import HybridEngineFeature
from dsrun.utils.logging import logger

__all__ = ["DeepSpeedHybridEngine"]


class DeepSpeedHybridEngine(DeepSpeedEngine):
    r"""DeepSpeed engine for training and inference."""

    inference_mp_group = None
    _t_start: float | None = None
    _total_latency = 0.0
    _iters = 0
    _training_latency = 0.0
    _training_start_time: float | None = None

    @property
    def hybrid(self) -> HybridEngineFeature:
        feature = self.features.get(HybridEngineFeature)
        assert feature is not None, "DeepSpeedHybridEngine is built by dsrun.initialize with hybrid_engine.enabled"
        return feature

    @property
    def Z3_enabled(self) -> bool:  # noqa: N802 (DeepSpeed's name)
        return int(self._config.zero_optimization.stage) == 3

    @property
    def gather_all_layers(self) -> bool:
        return bool(self._config.hybrid_engine.pin_parameters)

    @property
    def mp_group(self) -> Any:
        """The tensor-parallel group generation splits the layers over (None: the whole world, or no split)."""
        return self.hybrid.tp.group

    @property
    def _gather_latency(self) -> float:
        return self.hybrid.gather_latency

    @property
    def _generate_latency(self) -> float:
        return self.hybrid.generate_latency

    def generate(self, *inputs: torch.Tensor, **kwargs: object) -> Any:
        """The module's ``generate`` as the ``hybrid_engine`` section arranges it (collective at ZeRO-3)."""
        return self.hybrid.generate(*inputs, **kwargs)

    def release_inference_cache(self) -> None:
        """Free the inference workspace now (``hybrid_engine.release_inference_cache`` does after each generate)."""
        self.hybrid.release_workspace()

    def eval(self) -> "DeepSpeedHybridEngine":
        """Evaluation mode; logs, on rank 0, the time since the last ``eval()`` split as DeepSpeed's engine does."""
        if self._t_start is not None:
            latency = time.time() - self._t_start
            self._total_latency += latency
            self._iters += 1
            if comm.get_rank() == 0:
                logger.info(self.hybrid.latency_line(latency, self._training_latency))
        self._t_start = time.time()
        self._training_latency = 0.0
        return super().eval()

    def train(self, mode: bool = True) -> "DeepSpeedHybridEngine":
        super().train(mode)
        if mode:
            self._training_start_time = time.time()
        return self

    def step(self, lr_kwargs: dict | None = None) -> None:
        super().step(lr_kwargs=lr_kwargs)
        if self._training_start_time is not None:  # the training share of DeepSpeed's latency line
            now = time.time()
            self._training_latency += now - self._training_start_time
            self._training_start_time = now
