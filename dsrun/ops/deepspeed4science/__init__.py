"""``deepspeed.ops.deepspeed4science``: DeepSpeed4Science's Evoformer attention in torch (:mod:`.evoformer_attn`)."""
from dsrun.ops.deepspeed4science.evoformer_attn import DS4Sci_EvoformerAttention, EvoformerFusedAttention

__all__ = ["DS4Sci_EvoformerAttention", "EvoformerFusedAttention"]
