"""A tokenised corpus split into train and eval, and the loaders that read it.

Every data source (the Python standard library, user text, pre-tokenised files) ends as a
:class:`TokenCorpus`: two flat token arrays plus what is needed to read them. The split is deterministic:
the last ``eval_fraction`` of the token stream is the eval split, the rest is train, so no train window
shares a token position with an eval window.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dsrun.data.dataset import TokenWindows
from dsrun.data.sampler import EvalLoader, TrainLoader
from dsrun.data.tokenizers import Tokenizer
from dsrun.utils.errors import Problem, UserError


def split_tokens(tokens: np.ndarray, eval_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)``: the eval split is the last ``eval_fraction`` of the tokens (at least one window
    when the fraction is positive), the train split everything before it."""
    if not 0.0 <= eval_fraction < 1.0:
        raise UserError(Problem("data.eval_fraction", f"must be in [0, 1), got {eval_fraction!r}"))
    total = len(tokens)
    if eval_fraction == 0.0:
        return tokens, tokens[total:]
    eval_size = max(int(round(total * eval_fraction)), seq_len + 1)
    cut = total - eval_size
    if cut < seq_len + 1:
        raise UserError(Problem("data", f"{total} tokens are too few for a train and an eval window of "
                                f"seq_len={seq_len}", "use more text, a smaller data.seq_len or eval_fraction=0"))
    return tokens[:cut], tokens[cut:]


@dataclass
class TokenCorpus:
    """Train and eval token arrays with their vocabulary; build loaders per rank from it.

    ``vocab_size`` bounds every id (ids are in ``[0, vocab_size)``); the model's ``vocab_size`` must be at
    least this (:meth:`check_vocab`). ``from_cache`` says whether the tokens came from the on-disk cache.
    """

    train_tokens: np.ndarray
    eval_tokens: np.ndarray
    seq_len: int
    vocab_size: int
    description: str
    tokenizer: Tokenizer | None = None
    from_cache: bool = False
    sources: list[str] = field(default_factory=list)

    @property
    def train(self) -> TokenWindows:
        return TokenWindows(self.train_tokens, self.seq_len, name=f"{self.description} (train)")

    @property
    def eval(self) -> TokenWindows:
        return TokenWindows(self.eval_tokens, self.seq_len, name=f"{self.description} (eval)")

    def train_loader(self, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                     shuffle: bool = True) -> TrainLoader:
        """Endless, deterministic, resumable ``(inputs, targets)`` micro-batches for one rank."""
        return TrainLoader(self.train, batch_size, rank, world_size, seed, shuffle)

    def eval_loader(self, batch_size: int, rank: int = 0, world_size: int = 1,
                    max_batches: int | None = None) -> EvalLoader:
        """The same eval batches on every pass (for a comparable eval loss over training)."""
        return EvalLoader(self.eval, batch_size, rank, world_size, max_batches)

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise a one-line error when token ids could index past the model's embedding table."""
        if model_vocab_size < self.vocab_size:
            raise UserError(Problem("model.vocab_size", f"{model_vocab_size} is smaller than the data's "
                                    f"vocabulary ({self.vocab_size}, {self.description})",
                                    f"set model.vocab_size={self.vocab_size} or more"))

    def decode(self, ids: "list[int] | np.ndarray") -> str:
        """Text of token ids, when the corpus knows its tokenizer."""
        if self.tokenizer is None:
            raise ValueError(f"{self.description} has no tokenizer to decode with")
        return self.tokenizer.decode([int(i) for i in ids])

    def summary(self) -> str:
        cached = ", from cache" if self.from_cache else ""
        return (f"{self.description}: {len(self.train_tokens):,} train + {len(self.eval_tokens):,} eval tokens, "
                f"vocab {self.vocab_size}, {len(self.train):,} train windows of {self.seq_len}{cached}")
