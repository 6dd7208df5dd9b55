"""Data efficiency (DeepSpeed's ``deepspeed.runtime.data_pipeline``, plus ``progressive_layer_drop``).

- :class:`CurriculumScheduler`: the pacing functions of the legacy ``curriculum_learning`` section and of every
  curriculum metric;
- ``data_sampling``: :class:`DataAnalyzer` (offline difficulty indexes), :class:`DeepSpeedDataSampler` (batches
  under the current difficulty);
- ``data_routing``: random-LTD (:func:`convert_to_random_ltd`, :func:`remove_random_ltd_state_dict`,
  :class:`RandomLTDScheduler`);
- :class:`ProgressiveLayerDrop`: θ(t) for progressive layer drop;
- :class:`~dsrun.data_efficiency.features.DataEfficiency`: what the engine calls at its seams.

Guide and measured results: ``docs/data_efficiency.md``.
"""
from dsrun.data_efficiency.curriculum_scheduler import CurriculumScheduler
from dsrun.data_efficiency.data_routing import RandomLayerTokenDrop, RandomLTDScheduler, convert_to_random_ltd, remove_random_ltd_state_dict
from dsrun.data_efficiency.data_sampling import DataAnalyzer, DeepSpeedDataSampler
from dsrun.data_efficiency.progressive_layer_drop import ProgressiveLayerDrop

__all__ = ["CurriculumScheduler", "DataAnalyzer", "DeepSpeedDataSampler", "ProgressiveLayerDrop",
           "RandomLTDScheduler", "RandomLayerTokenDrop", "convert_to_random_ltd", "remove_random_ltd_state_dict"]
