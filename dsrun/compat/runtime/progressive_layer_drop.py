"""DeepSpeed's module path ``deepspeed.runtime.progressive_layer_drop``; the class lives with the other data
efficiency techniques in :mod:`dsrun.data_efficiency.progressive_layer_drop`."""
from dsrun.data_efficiency.progressive_layer_drop import ProgressiveLayerDrop

__all__ = ["ProgressiveLayerDrop"]
