"""``deepspeed.inference.v2.kernels.ragged_ops``: DeepSpeed's ragged-batch kernels (CUDA in DeepSpeed) as torch
implementations of the same math on the same layouts and signatures: attention atoms and blocked attention
(``blocked_flash``), the KV-cache copy with and without rotary embeddings (``linear_blocked_kv_rotary``), the
ragged embedding and the last-token gather (``embed``), the MoE top-k gating, scatter and gather
(``moe_routing``). They run wherever torch runs; docs/inference.md."""
from .blocked_flash import AtomBuilder, BlockedFlashAttn, get_kv_block_size, get_q_block_size
from .embed import RaggedEmbeddingKernel, RaggedLogitsGather
from .linear_blocked_kv_rotary import BlockedRotaryEmbeddings, BlockedTrainedRotaryEmbeddings, LinearBlockedKVCopy
from .moe_routing import MoEGather, MoEScatter, RaggedTopKGating

__all__ = ["AtomBuilder", "BlockedFlashAttn", "BlockedRotaryEmbeddings", "BlockedTrainedRotaryEmbeddings",
           "LinearBlockedKVCopy", "MoEGather", "MoEScatter", "RaggedEmbeddingKernel", "RaggedLogitsGather",
           "RaggedTopKGating", "get_kv_block_size", "get_q_block_size"]
