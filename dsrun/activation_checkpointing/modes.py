"""Which blocks of a model are checkpointed, and how: ``none | full | every_N | selective``.

``model.activation_checkpointing`` of dsrun's GPT takes one of these (``true``/``false`` mean ``full``/``none``):

* ``none``: every block keeps its activations;
* ``full``: every block is checkpointed (only its input is kept);
* ``every_N``: blocks ``0, N, 2N, ...`` are checkpointed, the others keep their activations (``every_2``
  halves the saving and the recompute of ``full``);
* ``selective``: every block is checkpointed with :class:`~.selective.TransformerBlockPolicy`, which keeps
  the outputs of its expensive operations and recomputes the cheap ones.

:class:`BlockCheckpointing` applies a mode in a model's block loop; the memory estimator reads the same
:class:`CheckpointMode` to count what each mode keeps.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from dsrun.utils.errors import ConfigError, Problem, show
from dsrun.utils.suggest import did_you_mean

if TYPE_CHECKING:
    import torch

KINDS = ("none", "full", "every_N", "selective")
_EVERY = re.compile(r"every_(\d+)")

CheckpointFn = Callable[..., Any]


@dataclass(frozen=True)
class CheckpointMode:
    """A parsed mode: ``kind`` is none, full, every or selective; ``every`` the N of ``every_N``."""

    kind: str = "none"
    every: int = 1

    @classmethod
    def parse(cls, value: CheckpointMode | str | bool | None,
              key: str = "model.activation_checkpointing") -> "CheckpointMode":
        """``none``, ``full``, ``every_N`` (N >= 1; ``every_1`` is ``full``), ``selective``, a bool, None or a
        mode; anything else is a ConfigError naming ``key``."""
        if isinstance(value, CheckpointMode):
            return value
        if value is None or value is False:
            return cls("none")
        if value is True:
            return cls("full")
        text = str(value).strip().lower() if isinstance(value, str) else ""
        if text in ("none", "full", "selective"):
            return cls(text)
        match = _EVERY.fullmatch(text)
        if match and int(match.group(1)) >= 1:
            every = int(match.group(1))
            return cls("full") if every == 1 else cls("every", every)
        raise ConfigError(Problem(key, f"got {show(value)}; allowed: none, full, every_N (N >= 1, e.g. every_2), "
                                  "selective, or true/false", did_you_mean(text, ["none", "full", "selective",
                                                                                 "every_2"])))

    def __str__(self) -> str:
        return f"every_{self.every}" if self.kind == "every" else self.kind

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def checkpoints(self, index: int) -> bool:
        """Whether block ``index`` (from 0) is checkpointed."""
        if self.kind == "every":
            return index % self.every == 0
        return self.kind != "none"

    def checkpointed_blocks(self, n_layer: int) -> int:
        """How many of ``n_layer`` blocks are checkpointed."""
        return sum(self.checkpoints(i) for i in range(n_layer))


def default_checkpoint_fn(mode: CheckpointMode) -> CheckpointFn:
    """``selective_checkpoint`` for the selective mode, ``non_reentrant_checkpoint`` otherwise."""
    if mode.kind == "selective":
        from dsrun.activation_checkpointing.selective import selective_checkpoint

        return selective_checkpoint
    from dsrun.activation_checkpointing.checkpoint import non_reentrant_checkpoint

    return non_reentrant_checkpoint


class BlockCheckpointing:
    """Runs block ``index`` of a model checkpointed or not, as ``mode`` says: ``runner(index, block, hidden)``.

    ``checkpoint_fn(block, hidden)`` defaults to :func:`default_checkpoint_fn` (dsrun's non-reentrant
    checkpoint, which follows :func:`dsrun.checkpointing.configure`)."""

    def __init__(self, mode: CheckpointMode | str | bool | None = "none", checkpoint_fn: CheckpointFn | None = None):
        self.mode = CheckpointMode.parse(mode)
        self.checkpoint_fn = checkpoint_fn or default_checkpoint_fn(self.mode)

    def __call__(self, index: int, block: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        if self.mode.checkpoints(index):
            return self.checkpoint_fn(block, hidden)
        return block(hidden)

    def __repr__(self) -> str:
        return f"BlockCheckpointing({self.mode})"
