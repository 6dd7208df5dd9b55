"""DeepSpeed's v1 inference kernels (``deepspeed.ops.transformer.inference``) in torch: the kernels
(:mod:`.kernels`, what ``InferenceBuilder().load()`` and ``SpatialInferenceBuilder().load()`` return), the op
classes over them (:mod:`.op_binding`) and their :class:`DeepSpeedInferenceConfig` (:mod:`.config`).
docs/transformer_kernel.md lists them."""
from dsrun.ops.transformer.inference.config import DeepSpeedInferenceConfig

__all__ = ["DeepSpeedInferenceConfig"]
