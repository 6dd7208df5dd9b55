"""``deepspeed.inference.v2.model_implementations.flat_model_helpers``: a model's parameters in one flat buffer.

``flatten_inference_model`` copies every parameter of the layer containers (and its auxiliary tensors) into one
uint8 buffer, each at a 256-byte aligned offset with its own dtype, shape and strides (a transposed weight stays
transposed), re-points the containers at views of it, and returns the buffer with ``ModelMetadata`` describing
where each tensor is; ``restore_inference_model`` rebuilds the views onto such a buffer (a saved engine is one
buffer and one metadata file per rank, ``make_param_filename``/``make_metadata_filename``)."""
from __future__ import annotations

from os import path
from typing import Dict, Iterable, Optional, Tuple

import torch

from dsrun.config.config_utils import DeepSpeedConfigModel

from ..allocator import current_device, view_on_bytes
from ..inference_parameter import STR_TO_DTYPE, InferenceParameter
from ..inference_utils import elem_size
from .layer_container_base import LayerContainer

ALIGNMENT = 256


def pad_to_aligned_offset(offset: int, alignment: int = ALIGNMENT) -> int:
    """``offset`` rounded up to a multiple of ``alignment``."""
    return -(-offset // alignment) * alignment


class TensorMetadata(DeepSpeedConfigModel):
    dtype: Optional[str] = None
    shape: Optional[Tuple[int, ...]] = None
    strides: Optional[Tuple[int, ...]] = None
    offset: int
    """Byte offset in the flat buffer; -1 for a parameter the model does not have (None)."""


class ParameterMetadata(DeepSpeedConfigModel):
    core_param: Optional[TensorMetadata] = None
    aux_params: Dict[str, TensorMetadata] = {}


class LayerMetadata(DeepSpeedConfigModel):
    params: Dict[str, ParameterMetadata] = {}


class ModelMetadata(DeepSpeedConfigModel):
    policy: str = ""
    layers: Dict[str, LayerMetadata] = {}


def make_param_filename(base: str, rank: int, n_ranks: int) -> str:
    return path.join(base, f"params_rank_{rank}_of_{n_ranks}.pt")


def make_metadata_filename(base: str, rank: int, n_ranks: int) -> str:
    return path.join(base, f"metadata_rank_{rank}_of_{n_ranks}.json")


def make_model_config_filename(base: str) -> str:
    return path.join(base, "ds_model_config.json")


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor's elements span with its strides (its numel for a contiguous or a permuted one)."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * elem_size(
        tensor.dtype)


def _describe(tensor: torch.Tensor, offset: int) -> TensorMetadata:
    return TensorMetadata(dtype=str(tensor.dtype), shape=tuple(tensor.shape), strides=tuple(tensor.stride()),
                          offset=offset)


def _view(buffer: torch.Tensor, meta: TensorMetadata) -> torch.Tensor:
    return view_on_bytes(tuple(meta.shape), tuple(meta.strides), STR_TO_DTYPE[meta.dtype], buffer, meta.offset)


def _layers(transformer_containers: Iterable[LayerContainer],
            non_transformer_container: LayerContainer) -> list[tuple[str, LayerContainer]]:
    layers = [(f"transformer_layer_{i}", layer) for i, layer in enumerate(transformer_containers)]
    return layers + [("non_transformer", non_transformer_container)]


def flatten_inference_model(transformer_containers: Iterable[LayerContainer], non_transformer_container: LayerContainer,
                            policy_name: str) -> Tuple[torch.Tensor, ModelMetadata]:
    """Copy the containers' parameters into one flat buffer and point the containers at it; returns the buffer
    (uint8 on the device) and its metadata. ValueError naming a container that is not populated."""
    layers = _layers(transformer_containers, non_transformer_container)
    metadata = ModelMetadata(policy=policy_name)
    offset = 0
    for layer_name, layer in layers:
        try:
            layer.is_populated
        except ValueError as e:
            raise ValueError(f"Layer container {layer_name} is not populated.") from e
        layer_meta = LayerMetadata()
        for name in layer.annotation_attrs:
            param = getattr(layer, name)
            if param is None:
                layer_meta.params[name] = ParameterMetadata(core_param=TensorMetadata(offset=-1))
                continue
            param_meta = ParameterMetadata(core_param=_describe(param, offset))
            offset += pad_to_aligned_offset(_extent_bytes(param))
            for aux_name, aux in getattr(param, "aux_attrs", {}).items():
                param_meta.aux_params[aux_name] = _describe(aux, offset)
                offset += pad_to_aligned_offset(_extent_bytes(aux))
            layer_meta.params[name] = param_meta
        metadata.layers[layer_name] = layer_meta
    buffer = torch.empty(offset, dtype=torch.uint8, device=current_device())
    for layer_name, layer in layers:
        for name in layer.annotation_attrs:
            param = getattr(layer, name)
            if param is None:
                continue
            param_meta = metadata.layers[layer_name].params[name]
            core = _view(buffer, param_meta.core_param)
            core.copy_(param)
            aux_views = {}
            for aux_name, aux in getattr(param, "aux_attrs", {}).items():
                aux_views[aux_name] = _view(buffer, param_meta.aux_params[aux_name])
                aux_views[aux_name].copy_(aux)
            setattr(layer, name, InferenceParameter.initialize(core, **aux_views))
    return buffer, metadata


def restore_inference_model(buffer: torch.Tensor, metadata: ModelMetadata,
                            transformer_containers: Iterable[LayerContainer],
                            non_transformer_container: LayerContainer) -> None:
    """Give the containers views onto ``buffer`` as ``metadata`` describes (no data is copied)."""
    for layer_name, layer in _layers(transformer_containers, non_transformer_container):
        layer_meta = metadata.layers[layer_name]
        for name in layer.annotation_attrs:
            param_meta = layer_meta.params[name]
            if param_meta.core_param.offset == -1:
                layer.direct_injection(name, None)
                continue
            aux_views = {aux_name: _view(buffer, aux_meta) for aux_name, aux_meta in param_meta.aux_params.items()}
            layer.direct_injection(name, InferenceParameter.initialize(_view(buffer, param_meta.core_param),
                                                                      **aux_views))
