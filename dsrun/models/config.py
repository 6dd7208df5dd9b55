"""The typed configuration of the built-in GPT, and its analytic parameter count.

``GPTConfig`` is what ``conf/model/*.yaml`` fill in (as keyword arguments of :class:`dsrun.models.gpt.GPT`).
Counting parameters from the config alone lets the memory estimator and the autotuner size a 13B model
without building it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from dsrun.activation_checkpointing.modes import CheckpointMode
from dsrun.utils.errors import ConfigError, Problem, show
from dsrun.utils.suggest import did_you_mean

POSITIONS = ("learned", "rotary")
ATTENTIONS = ("dense", "sparse")


# The value of one GPTConfig field, as keyword arguments and YAML give it.
GPTOption = int | float | str | dict[str, Any] | None


@dataclass(frozen=True)
class GPTConfig:
    """Shape and options of a GPT decoder.

    ``block_size`` is the longest sequence the model accepts (the context length); the data layer's
    ``seq_len`` must not exceed it. ``positions="learned"`` adds a ``block_size x n_embd`` position table;
    ``"rotary"`` rotates queries and keys instead and has no position parameters. ``attention="sparse"``
    computes causal block-sparse attention over the layout ``sparse_attention`` describes (the DeepSpeed
    config's ``sparse_attention`` section; the ``attention=sparse`` config option passes
    ``ds.sparse_attention`` here; unset keys take the section's defaults); see docs/sparse_attention.md.
    ``activation_checkpointing`` is ``none``, ``full``, ``every_N`` or ``selective`` (``true``/``false``:
    full/none; :class:`~dsrun.activation_checkpointing.modes.CheckpointMode`), kept in that spelling.
    ``pipeline_stages > 1`` cuts the model into that many pipeline stages: ``dsrun train`` then builds it as a
    ``PipelineModule`` (:func:`dsrun.workloads.pipeline.gpt_pipeline`, docs/pipeline.md) instead of a
    :class:`~dsrun.models.gpt.GPT` (a ``GPT`` object is always the whole model; the estimator and the
    autotuner count it whole too). ``sequence_parallel`` runs attention as DeepSpeed-Ulysses
    (:class:`dsrun.sequence.layer.DistributedAttention`) over the engine's sequence-parallel group
    (``ds.sequence_parallel_size``): each rank of the group keeps 1/S of every sequence (docs/sequence_parallel.md).
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    positions: str = "learned"
    tie_embeddings: bool = True
    activation_checkpointing: str = "none"
    rotary_base: float = 10000.0
    attention: str = "dense"
    sparse_attention: dict[str, Any] | None = None
    pipeline_stages: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "pipeline_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(Problem(f"model.{name}", f"must be a positive integer, got {show(value)}"))
        if not problems and self.n_embd % self.n_head:
            problems.append(Problem("model.n_embd", f"{self.n_embd} is not divisible by n_head={self.n_head}",
                                    "pick n_embd as a multiple of n_head"))
        if not problems and self.positions == "rotary" and (self.n_embd // self.n_head) % 2:
            problems.append(Problem("model.positions", "rotary needs an even head size "
                                    f"(n_embd/n_head = {self.n_embd // self.n_head})", "use positions=learned"))
        if not problems and self.pipeline_stages > self.pipeline_layers:  # a stage without a layer trains nothing
            problems.append(Problem("model.pipeline_stages", f"{self.pipeline_stages} stages but a GPT of n_layer="
                                    f"{self.n_layer} is {self.pipeline_layers} pipeline layers (embedding, positions, "
                                    f"{self.n_layer} block(s), final norm, head)", f"use at most {self.pipeline_layers} "
                                    "stages, or raise model.n_layer"))
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= float(self.dropout) < 1.0:
            problems.append(Problem("model.dropout", f"must be in [0, 1), got {show(self.dropout)}"))
        if self.positions not in POSITIONS:
            problems.append(Problem("model.positions", f"unknown value {show(self.positions)}; allowed: "
                                    + ", ".join(POSITIONS), did_you_mean(str(self.positions), POSITIONS)))
        if self.attention not in ATTENTIONS:
            problems.append(Problem("model.attention", f"unknown value {show(self.attention)}; allowed: "
                                    + ", ".join(ATTENTIONS), did_you_mean(str(self.attention), ATTENTIONS)))
        if self.sparse_attention is not None and self.attention != "sparse":
            problems.append(Problem("model.sparse_attention", "is set but model.attention is 'dense', so no layer "
                                    "would read it", "set model.attention=sparse or drop model.sparse_attention"))
        if self.sequence_parallel and self.attention != "dense":
            problems.append(Problem("model.sequence_parallel", "runs dense attention only (the block-sparse "
                                    "layout spans the whole sequence)", "set model.attention=dense"))
        try:
            mode = CheckpointMode.parse(self.activation_checkpointing)
            object.__setattr__(self, "activation_checkpointing", str(mode))  # the canonical spelling
        except ConfigError as err:
            problems.extend(err.problems)
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_kwargs(cls, values: Mapping[str, Any]) -> "GPTConfig":
        """Build from keyword arguments (a YAML section), naming any unknown key with a suggestion."""
        known = [f.name for f in fields(cls)]
        unknown = [key for key in values if key not in known]
        if unknown:
            raise ConfigError([Problem(f"model.{key}", "is not a GPT option; allowed: " + ", ".join(known),
                                       did_you_mean(key, known)) for key in unknown])
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def pipeline_layers(self) -> int:
        """How many layers the pipelined GPT has (:func:`dsrun.models.gpt_pipe.pipeline_layers`): embedding,
        positions, the blocks, final norm, head."""
        return self.n_layer + 4

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """The exact parameter count of ``GPT(self)``, shared (tied) parameters counted once.

        Per block: ``12·d²`` weights (q,k,v: 3d², attention out: d², MLP: 8d²), plus ``9·d`` linear biases
        and two LayerNorms (``2·d`` weights, ``2·d`` more with biases). Outside the blocks: the token table
        ``V·d``, the learned position table ``block_size·d``, the final LayerNorm, and an untied output
        head ``V·d``. ``exclude_embeddings`` drops the token and position tables (and the head when tied,
        since it *is* the token table), which is the usual "non-embedding" count.
        """
        d, n_layer = self.n_embd, self.n_layer
        norm = d * (2 if self.bias else 1)
        block = 12 * d * d + (9 * d if self.bias else 0) + 2 * norm
        total = n_layer * block + norm
        if not exclude_embeddings:
            total += self.vocab_size * d
            if self.positions == "learned":
                total += self.block_size * d
        if not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    def largest_layer_params(self) -> int:
        """Parameters of the largest single module (what ZeRO-3 gathers at once): see ``largest_layer_params``."""
        d = self.n_embd
        candidates = [
            self.vocab_size * d,  # token embedding (and the tied head)
            4 * d * d + (4 * d if self.bias else 0),  # MLP up-projection
        ]
        if self.positions == "learned":
            candidates.append(self.block_size * d)
        return max(candidates)
