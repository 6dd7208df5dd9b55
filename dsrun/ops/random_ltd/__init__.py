"""Random-LTD's token ops (DeepSpeed's ``deepspeed.ops.random_ltd``), in plain torch: see ``dropping_utils``."""
from .dropping_utils import (GatherTokens, ScatterTokens, bert_sample_tokens, gather_tokens, gpt_sample_tokens,
                             scatter_tokens)

__all__ = ["GatherTokens", "ScatterTokens", "bert_sample_tokens", "gather_tokens", "gpt_sample_tokens",
           "scatter_tokens"]
