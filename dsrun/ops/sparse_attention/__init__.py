"""Block-sparse self-attention with DeepSpeed's API, in plain torch (CPU and CUDA).

- Layouts: :class:`SparsityConfig` and its patterns ``Dense``, ``Fixed``, ``Variable``, ``BigBird``,
  ``BSLongformer``, ``LocalSlidingWindow`` (:mod:`.sparsity_config`); :func:`sparsity_config_from_dict`
  builds one from the DeepSpeed config's ``sparse_attention`` section.
- Modules: :class:`SparseSelfAttention` (DeepSpeed's), :class:`BertSparseSelfAttention`, and dsrun's
  :class:`CausalSparseSelfAttention` used by the built-in GPT (``model.attention: sparse``).
- :class:`SparseAttentionUtils`: pad to the block size, extend position embeddings, swap a BERT/RoBERTa or
  GPT model's self-attention for sparse attention.
- The computation: :func:`block_sparse_attention` (:mod:`.block_sparse`).

Details and measurements: docs/sparse_attention.md.
"""
from dsrun.ops.sparse_attention.block_sparse import BlockIndex, block_index, block_sparse_attention
from dsrun.ops.sparse_attention.bert_sparse_self_attention import BertSparseSelfAttention
from dsrun.ops.sparse_attention.from_config import sparsity_config_from_dict
from dsrun.ops.sparse_attention.sparse_attention_utils import SparseAttentionUtils
from dsrun.ops.sparse_attention.sparse_self_attention import CausalSparseSelfAttention, SparseSelfAttention
from dsrun.ops.sparse_attention.sparsity_config import (BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                                        DenseSparsityConfig, FixedSparsityConfig,
                                                        LocalSlidingWindowSparsityConfig, SparsityConfig,
                                                        VariableSparsityConfig)

__all__ = ["BertSparseSelfAttention", "BigBirdSparsityConfig", "BlockIndex", "BSLongformerSparsityConfig",
           "CausalSparseSelfAttention", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparseAttentionUtils", "SparseSelfAttention", "SparsityConfig",
           "VariableSparsityConfig", "block_index", "block_sparse_attention", "sparsity_config_from_dict"]
