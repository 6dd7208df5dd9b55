"""``deepspeed.runtime.rollout``: DeepSpeed's rollout interface for on-policy generation in RL or distillation.

A trainer asks its rollout engine for samples through three dataclasses (``RolloutRequest`` in, ``RolloutBatch``
out, ``SamplingConfig``) and one abstract class, ``RolloutEngine`` (``generate``, ``sync_weights``,
``shutdown``); ``build_rollout(RolloutConfig(...), student_engine, tokenizer)`` picks the engine.

``HybridEngineRollout`` generates with the training engine's own module (Hugging Face ``generate``), so the
samples always come from the current weights and ``sync_weights`` has nothing to push; under ZeRO-3 each
forward gathers its parameters as in training. ``use_graph_capture`` (DeepSpeed's CUDA-graph decode) is refused:
dsrun captures no CUDA graphs. ``HybridEngineRollout._sample_top_p`` is DeepSpeed's temperature and nucleus
sampling of one token per row.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from dsrun.utils.errors import ConfigError


@dataclass
class RolloutConfig:
    engine: str = "hybrid_engine"
    use_graph_capture: bool = False


@dataclass
class HybridEngineRolloutConfig:
    """``HybridEngineRollout``'s own options (``RolloutConfig`` carries the same flag)."""

    use_graph_capture: bool = False


@dataclass
class SamplingConfig:
    """What each ``generate`` call samples: ``temperature <= 0`` is greedy; ``top_k`` -1 is off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1


def _check_pair(ids: torch.Tensor, mask: torch.Tensor, ids_name: str, mask_name: str, ids_shape: str) -> None:
    if ids.dim() != 2:
        raise ValueError(f"{ids_name} must be 2-D {ids_shape}; got {tuple(ids.shape)}")
    if mask.shape != ids.shape:
        raise ValueError(f"{mask_name} shape {tuple(mask.shape)} does not match {ids_name} {tuple(ids.shape)}")


@dataclass
class RolloutRequest:
    """Prompts, left-padded (real tokens at the right edge), and their attention mask (1 on real tokens)."""

    prompt_ids: torch.Tensor  # [B, T_p]
    prompt_attention_mask: torch.Tensor  # [B, T_p]

    def __post_init__(self) -> None:
        _check_pair(self.prompt_ids, self.prompt_attention_mask, "prompt_ids", "prompt_attention_mask", "[B, T_p]")


@dataclass
class RolloutBatch:
    """Prompt and response in one tensor per sample (``B * n_samples_per_prompt`` rows), the response of row i
    starting at column ``response_start_idx[i]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        _check_pair(self.input_ids, self.attention_mask, "input_ids", "attention_mask", "[B, T]")
        rows = self.input_ids.shape[0]
        if self.response_start_idx.shape != (rows, ):
            raise ValueError(f"response_start_idx must be 1-D of length {rows}; got "
                             f"{tuple(self.response_start_idx.shape)}")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class _Tokenizer(Protocol):
    pad_token_id: int | None
    eos_token_id: int | None


class _TrainingEngine(Protocol):
    module: torch.nn.Module  # a Hugging Face model: it has ``generate``


class RolloutEngine(ABC):
    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Prompt and response in one tensor."""

    @abstractmethod
    def sync_weights(self, step: int) -> None:
        """Push the trained weights to the rollout backend (nothing to do where it shares them)."""

    def shutdown(self) -> None:
        return None


class HybridEngineRollout(RolloutEngine):
    """Generation with the training engine's module itself (module docstring)."""

    name = "hybrid_engine"

    def __init__(self, engine: _TrainingEngine, tokenizer: _Tokenizer,
                 cfg: RolloutConfig | HybridEngineRolloutConfig | None = None):
        self.use_graph_capture = bool(getattr(cfg, "use_graph_capture", False))
        if self.use_graph_capture:
            raise ConfigError("rollout use_graph_capture: DeepSpeed's CUDA-graph decode is not provided by dsrun; "
                              "set it to False (generation runs Hugging Face generate)")
        self.engine = engine
        self.tokenizer = tokenizer

    @staticmethod
    def _sample_top_p(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
        """One token per row of ``logits`` [B, V] ([B, 1]): softmax at ``temperature``, sampled from the
        smallest set of most likely tokens whose probability reaches ``top_p`` (DeepSpeed's helper)."""
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p >= 1.0:
            return torch.multinomial(probs, 1)
        sorted_probs, order = torch.sort(probs, descending=True, dim=-1)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the mass before a token already reaches top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        return order.gather(1, torch.multinomial(sorted_probs, 1))

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        n = sampling.n_samples_per_prompt
        prompt_ids = request.prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = request.prompt_attention_mask.repeat_interleave(n, dim=0)
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        sample = sampling.temperature > 0.0
        # top_k -1 (off) is Hugging Face's 0; DeepSpeed leaves it at the model's generation default
        options = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                       top_k=max(sampling.top_k, 0)) if sample else dict(do_sample=False)
        output = self.engine.module.generate(prompt_ids, attention_mask=prompt_mask,
                                             max_new_tokens=sampling.max_new_tokens, pad_token_id=pad, **options)
        prompt_len = prompt_ids.shape[1]
        mask = (output != pad).to(prompt_mask.dtype)
        mask[:, :prompt_len] = prompt_mask  # a prompt's own tokens may equal the pad id
        return RolloutBatch(input_ids=output, attention_mask=mask,
                            response_start_idx=torch.full((output.shape[0], ), prompt_len, dtype=torch.long,
                                                          device=output.device))

    def sync_weights(self, step: int) -> None:
        return None  # generation reads the training weights themselves


def build_rollout(rollout_cfg: RolloutConfig, student_engine: _TrainingEngine | None = None,
                  tokenizer: _Tokenizer | None = None, **kwargs: object) -> RolloutEngine:
    """The rollout engine ``rollout_cfg.engine`` names (``"hybrid_engine"``: the student engine's own module)."""
    name = rollout_cfg.engine
    if name == "hybrid_engine":
        if student_engine is None or tokenizer is None:
            raise ValueError("hybrid_engine rollout needs both student_engine and tokenizer")
        return HybridEngineRollout(student_engine, tokenizer, rollout_cfg)
    raise ValueError(f"Unknown rollout engine {name!r}; choose from 'hybrid_engine'")


__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig", "RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest",
           "SamplingConfig", "build_rollout"]
