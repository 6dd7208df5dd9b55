"""The features dsrun builds into every engine, in the order their hooks run (:data:`dsrun.features.REGISTRY`).

Importing this module registers them; :mod:`dsrun.engine.engine` does so, so an engine built any way (``initialize``,
``DeepSpeedEngine(...)``, the pipeline's subclass) sees the same list. A room or a test adds its own feature with
:func:`dsrun.features.register_feature` after these. The pipeline's feature is not here: the model, not the
config, makes a run a pipeline run, so ``PipelineEngine`` builds it for its module (:mod:`dsrun.pipe.feature`).
"""
from __future__ import annotations

from dsrun.activation_checkpointing.settings import ActivationCheckpointingFeature
from dsrun.compression.feature import CompressionFeature
from dsrun.data_efficiency.features import DataEfficiency
from dsrun.features import Feature, register_feature
from dsrun.hybrid_engine import HybridEngineFeature
from dsrun.inference.quantization.feature import WeightQuantizationFeature
from dsrun.autoep.feature import AutoEPFeature
from dsrun.moe.feature import MoEFeature
from dsrun.optim.muon import MuonFeature
from dsrun.optim.onebit import OneBitFeature
from dsrun.sequence.feature import SequenceParallelFeature
from dsrun.tensor_parallel import AutoTPFeature
from dsrun.zero.grad_accum import GradientAccumulationFeature
from dsrun.zero.zenflow import ZenFlowFeature
from dsrun.zero.zeropp import ZeroPlusPlusFeature

BUILTIN: tuple[type[Feature], ...] = (
    DataEfficiency,  # curriculum / random-LTD: the batch a step sees (always built: DeepSpeed's getters read it)
    CompressionFeature,  # wraps layers before the optimizer sees their parameters
    WeightQuantizationFeature,  # weight_quantization: weights stored quantized before the optimizer sees them
    OneBitFeature,  # binds a 1-bit optimizer to the ZeRO strategy's step
    MuonFeature,  # Muon: marks use_muon before the optimizer; the whole-matrix update at the ZeRO step
    ActivationCheckpointingFeature,  # the activation_checkpointing section, configured at attach
    MoEFeature,  # expert groups, expert param groups, expert checkpoint files
    AutoEPFeature,  # expert_parallel: Hugging Face MoE blocks replaced by expert-parallel layers
    SequenceParallelFeature,  # Ulysses: the topology's sequence axis
    AutoTPFeature,  # AutoTP training: the topology's model axis, the model split over it
    ZeroPlusPlusFeature,  # ZeRO++ / MiCS / hpZ: stage 3's sharding policy
    ZenFlowFeature,  # ZenFlow: the selective, overlapped offloaded update of stages 1-2
    GradientAccumulationFeature,  # data_types.grad_accum_dtype: the dtype the ZeRO strategy accumulates in
    HybridEngineFeature,  # hybrid_engine: DeepSpeed-Chat's generate on the training engine
)

for _feature in BUILTIN:
    register_feature(_feature)
