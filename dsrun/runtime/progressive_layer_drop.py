"""DeepSpeed's module path ``deepspeed.runtime.progressive_layer_drop``; the class lives with the other data
efficiency techniques in :mod:`dsrun.runtime.data_pipeline.progressive_layer_drop`."""
from dsrun.runtime.data_pipeline.progressive_layer_drop import ProgressiveLayerDrop

__all__ = ["ProgressiveLayerDrop"]
