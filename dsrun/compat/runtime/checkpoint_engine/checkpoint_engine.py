"""``deepspeed.runtime.checkpoint_engine.checkpoint_engine`` (home: :mod:`dsrun.checkpoint.checkpoint_engine`)."""
from dsrun.checkpoint.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

__all__ = ["CheckpointCommitInfo", "CheckpointEngine"]
