"""``deepspeed.inference.quantization``: DeepSpeed's group-wise INT4/INT8 weight quantization of a model's linears
and embeddings (:mod:`.groupwise`, which serves DeepSpeed's ``utils``, ``layers`` and ``quantization`` modules; the
quantizer is :mod:`dsrun.ops.groupwise_quant`) and the engine feature of the ``weight_quantization`` section
(:mod:`.feature`)."""
from dsrun.inference.quantization.groupwise import (DeQuantizer, QuantizedEmbedding, QuantizedLinear, Quantizer,
                                                    _init_group_wise_weight_quantization, quantize_layers)

__all__ = ["DeQuantizer", "QuantizedEmbedding", "QuantizedLinear", "Quantizer", "_init_group_wise_weight_quantization",
           "quantize_layers"]
