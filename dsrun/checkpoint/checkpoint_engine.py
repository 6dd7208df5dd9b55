"""DeepSpeed's checkpoint-engine interface (``deepspeed.runtime.checkpoint_engine``): the object DeepSpeed's
engine and a ``PipelineModule``'s per-layer files are written and read through, for code that builds or passes
one. dsrun's own engine writes its files itself (:mod:`dsrun.checkpoint.atomic`, chosen by the config's
``checkpoint.writer`` section, docs/checkpoint.md); :class:`TorchCheckpointEngine` is DeepSpeed's default: plain
``torch.save`` / ``torch.load`` of the path it is given, each file whole, with nothing to commit."""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class CheckpointCommitInfo:
    """Which checkpoint a ``create`` / ``commit`` is about."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """DeepSpeed's base class: ``create`` before a checkpoint's files, ``save``/``load`` each file, ``commit``
    once they are all written (True when the checkpoint is complete)."""

    def __init__(self, config_params: object = None):
        self.name: str | None = None

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> None: ...

    @abc.abstractmethod
    def save(self, state_dict: object, path: str) -> None: ...

    @abc.abstractmethod
    def load(self, path: str, map_location: object = None) -> Any: ...

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool: ...

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether the rank of this data-parallel index writes the files every replica shares (the first)."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        """A decoupled engine's pending commit; a synchronous one has none."""

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return None

    def cleanup(self) -> None:
        """Release what the engine holds between checkpoints (nothing for a synchronous one)."""

    def preserves_storage_sharing(self) -> bool:
        """Whether tensors sharing a storage are saved once (``torch.save`` keeps views of one storage)."""
        return True


class TorchCheckpointEngine(CheckpointEngine):
    """``torch.save`` / ``torch.load`` of each file. Without ``config_params`` files are written in torch's legacy
    format; with DeepSpeed's config object, its ``checkpoint.checkpoint_serialization`` (default true: torch's
    zip-file format) decides, as in DeepSpeed."""

    def __init__(self, config_params: object = None):
        super().__init__(config_params)
        self.name = "TorchCheckpointEngine"
        self.zipfile_serialization = False
        if config_params is not None:
            checkpoint_config = getattr(config_params, "checkpoint_config", None) or {}
            self.zipfile_serialization = bool(checkpoint_config.get("checkpoint_serialization", True))

    def create(self, info: CheckpointCommitInfo) -> None:
        """Nothing to prepare: each file is written whole by :meth:`save`."""

    def save(self, state_dict: object, path: str) -> None:
        torch.save(state_dict, path, _use_new_zipfile_serialization=self.zipfile_serialization)

    def load(self, path: str, map_location: object = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True


__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]
