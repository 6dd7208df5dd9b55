"""``RepeatingLoader``: an iterator over a data loader that starts it again whenever it runs out (DeepSpeed's
``deepspeed.utils.RepeatingLoader``), so a pipeline's ``train_batch`` never meets ``StopIteration``."""
from __future__ import annotations

from typing import Any, Iterable, Iterator


class RepeatingLoader:
    """Wraps an iterable (a ``DataLoader``) and restarts it at its end."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
