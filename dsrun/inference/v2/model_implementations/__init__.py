"""``deepspeed.inference.v2.model_implementations``: the parameter containers and their mapping from checkpoint
names, the sharding helpers, the model bases and EXAONE 4.0/4.5 (see docs/inference.md for what runs on CPU)."""
from .common_parameters import (AttentionOutputParameter, Experts, EmbeddingParameter, FusedGatedMLPParameter,
                                FusedQKVParameter, GQAMegatronQKVParameter, GatedMLPParameter, InvFreqParameter,
                                MLP1Parameter, MLP2Parameter, MegatronQKVParameter, MoEGatingWeightParameter,
                                NormParameter, UnembedParameter, UnfusedMoEGatedMLPParameter,
                                UnfusedMoEMLP1Parameter, UnfusedMoEMLP2Parameter, UnfusedQKVParameter,
                                megatron_qkv_reshape, transform_gqa_megatron)
from .inference_transformer_base import DSInferenceModelBase, DSTransformerModelBase
from .layer_container_base import LayerContainer
from .parameter_base import ParameterBase, ParamList, ParametrizedList

__all__ = ["AttentionOutputParameter", "DSInferenceModelBase", "DSTransformerModelBase", "EmbeddingParameter",
           "Experts", "FusedGatedMLPParameter", "FusedQKVParameter", "GQAMegatronQKVParameter", "GatedMLPParameter",
           "InvFreqParameter", "LayerContainer", "MLP1Parameter", "MLP2Parameter", "MegatronQKVParameter",
           "MoEGatingWeightParameter", "NormParameter", "ParamList", "ParameterBase", "ParametrizedList",
           "UnembedParameter", "UnfusedMoEGatedMLPParameter", "UnfusedMoEMLP1Parameter", "UnfusedMoEMLP2Parameter",
           "UnfusedQKVParameter", "megatron_qkv_reshape", "transform_gqa_megatron"]
