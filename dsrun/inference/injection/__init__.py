"""DeepSpeed's v1 kernel injection (``replace_with_kernel_inject=True`` on a Hugging Face model): the injected
transformer layer (:mod:`.layer`, DeepSpeed's ``deepspeed.model_implementations``), the policies that say where
each family's weights are (:mod:`.policies`, ``deepspeed.module_inject.replace_policy``/``containers``) and the
replacement itself (:mod:`.replace`, ``deepspeed.module_inject.replace_module``). docs/inference.md has the
families and the figures."""
from .layer import (DeepSpeedBERTInference, DeepSpeedGPTInference, DeepSpeedLlama2Inference,
                    DeepSpeedMegatronGPTInference, DeepSpeedOPTInference, DeepSpeedTransformerInference)
from .replace import inject, policy_for, replace_transformer_layer

__all__ = ["DeepSpeedBERTInference", "DeepSpeedGPTInference", "DeepSpeedLlama2Inference",
           "DeepSpeedMegatronGPTInference", "DeepSpeedOPTInference", "DeepSpeedTransformerInference", "inject",
           "policy_for", "replace_transformer_layer"]
