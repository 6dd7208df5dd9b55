"""``deepspeed.runtime.checkpoint_engine``: DeepSpeed's checkpoint-engine classes (home:
:mod:`dsrun.checkpoint.checkpoint_engine`)."""
from dsrun.checkpoint.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine, TorchCheckpointEngine

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]
