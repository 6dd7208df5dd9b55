"""DeepSpeed's ragged MoE routing kernels (``top_k_gating``, ``moe_scatter``, ``moe_gather``): how a ragged
batch's tokens reach their experts and come back.

- :class:`RaggedTopKGating`: per real token, the softmax (float32) of its gate logits, its ``k`` largest
  (ties to the lower expert index, as ``torch.argmax``), their experts and the token's slot in each expert
  (``expert_counts`` counts them). The CUDA kernel numbers slots by atomic adds, in no fixed order; here in
  token order. Padding tokens get expert and slot -1.
- :class:`MoEScatter`: copies each token to row ``cumsum(expert_counts)[e - 1] + slot`` of the experts' input,
  so each expert's tokens are contiguous; returns that row per token (``mapped_slots``, -1 for padding).
- :class:`MoEGather`: each token's output is the sum of its experts' rows weighted by their gate scores
  (normalized to sum 1 when asked), in float32; resets ``expert_counts`` for the next pass."""
from __future__ import annotations

from typing import Tuple

import torch

from ...inference_utils import DtypeEnum
from ...ragged import RaggedBatchWrapper
from .. import DSKernelBase

UNASSIGNED = -1


class RaggedTopKGating(DSKernelBase):
    supported_logit_dtypes = [DtypeEnum.fp16, DtypeEnum.bf16, DtypeEnum.fp32]

    def __init__(self, logit_dtype: DtypeEnum) -> None:
        logit_dtype = DtypeEnum(logit_dtype)
        if logit_dtype not in RaggedTopKGating.supported_logit_dtypes:
            raise RuntimeError(f"Unsupported logit dtype {logit_dtype}")

    def __call__(self, expert_counts: torch.Tensor, scores: torch.Tensor, assignments: torch.Tensor,
                 offsets: torch.Tensor, logits: torch.Tensor,
                 batch: RaggedBatchWrapper) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``expert_counts`` [experts] must be zeros; ``scores``/``assignments``/``offsets`` [tokens, k] are
        filled."""
        n_tokens, top_k = int(batch.batch_metadata_buffer()[0]), scores.shape[1]
        token_logits = logits[:n_tokens].float()
        experts = token_logits.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
        scores[:n_tokens] = token_logits.softmax(dim=-1).gather(1, experts)
        assignments[:n_tokens] = experts.to(assignments.dtype)
        flat = experts.flatten()
        onehot = torch.nn.functional.one_hot(flat, logits.shape[1]).to(torch.int64)
        before = onehot.cumsum(dim=0) - onehot  # the token's rank among the earlier ones of the same expert
        slots = before.gather(1, flat.view(-1, 1)).view(n_tokens, top_k) + expert_counts.long()[experts]
        offsets[:n_tokens] = slots.to(offsets.dtype)
        expert_counts += onehot.sum(dim=0).to(expert_counts.dtype)
        assignments[n_tokens:] = UNASSIGNED
        offsets[n_tokens:] = UNASSIGNED
        return expert_counts, scores, assignments, offsets


class MoEScatter(DSKernelBase):
    supported_dtypes = [DtypeEnum.fp16, DtypeEnum.bf16]

    def __init__(self, dtype: DtypeEnum, channels: int) -> None:
        dtype = DtypeEnum(dtype)
        if dtype not in MoEScatter.supported_dtypes:
            raise RuntimeError(f"Unsupported dtype {dtype}")
        if channels % 8 != 0:
            raise RuntimeError(f"Channels {channels} must be divisible by 8")

    def __call__(self, moe_input: torch.Tensor, expert_cumsum: torch.Tensor, mapped_slots: torch.Tensor,
                 activations: torch.Tensor, expert_counts: torch.Tensor, assignments: torch.Tensor,
                 offsets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fills ``moe_input`` [tokens * k, channels], ``expert_cumsum`` [experts] (int64, inclusive) and
        ``mapped_slots`` [tokens, k]."""
        expert_cumsum.copy_(expert_counts.long().cumsum(dim=0))
        experts, slots = assignments.long(), offsets.long()
        assigned = experts != UNASSIGNED
        base = torch.cat([expert_cumsum.new_zeros(1), expert_cumsum[:-1]])[experts.clamp(min=0)]
        rows = torch.where(assigned, base + slots, torch.full_like(slots, UNASSIGNED))
        mapped_slots.copy_(rows.to(mapped_slots.dtype))
        tokens = torch.arange(experts.shape[0], device=experts.device).view(-1, 1).expand_as(experts)
        moe_input[rows[assigned]] = activations[tokens[assigned]].to(moe_input.dtype)
        return moe_input, expert_cumsum, mapped_slots


class MoEGather(DSKernelBase):
    supported_dtypes = [DtypeEnum.fp16, DtypeEnum.bf16]

    def __init__(self, dtype: DtypeEnum, channels: int, normalize_scores: bool = False) -> None:
        dtype = DtypeEnum(dtype)
        if dtype not in MoEGather.supported_dtypes:
            raise RuntimeError(f"Unsupported dtype {dtype}")
        if channels % 8 != 0:
            raise RuntimeError(f"Channels {channels} must be divisible by 8")
        self.normalize_scores = normalize_scores

    def __call__(self, layer_output: torch.Tensor, moe_output: torch.Tensor, scores: torch.Tensor,
                 mapped_slots: torch.Tensor, expert_counts: torch.Tensor) -> torch.Tensor:
        """Fills the rows of ``layer_output`` [tokens, channels] whose token was routed (others untouched)."""
        rows = mapped_slots.long()
        routed = (rows != UNASSIGNED).any(dim=1)
        weights = scores.float()
        if self.normalize_scores:
            total = weights.sum(dim=1, keepdim=True)
            weights = torch.where(total > 0, weights / total.clamp(min=torch.finfo(torch.float32).tiny), weights)
        picked = moe_output[rows[routed].clamp(min=0)].float() * weights[routed].unsqueeze(-1)
        layer_output[routed] = picked.sum(dim=1).to(layer_output.dtype)
        expert_counts.zero_()
        return layer_output
