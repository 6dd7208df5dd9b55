"""The compression library: quantization-aware training, pruning, layer reduction, MoQ, compressed export.

DeepSpeed's names: ``init_compression`` and ``redundancy_clean`` (also as
``dsrun.compression.compress.*``) and ``compression_scheduler``. ``dsrun.initialize`` applies a config's
``compression_training`` and ``quantize_training`` sections by itself; see docs/compression.md.
"""
from .compress import init_compression, redundancy_clean
from .scheduler import compression_scheduler

__all__ = ["compression_scheduler", "init_compression", "redundancy_clean"]
