"""``deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine`` (home: :mod:`dsrun.checkpoint.checkpoint_engine`)."""
from dsrun.checkpoint.checkpoint_engine import TorchCheckpointEngine

__all__ = ["TorchCheckpointEngine"]
