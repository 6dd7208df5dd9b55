"""AutoEP's experts: every local expert's SwiGLU weights as one ``[E, ...]`` tensor each, and the helpers that
put routed tokens in expert order and back.

``w1`` (gate) and ``w3`` (up) are ``[E, ffn, hidden]``, ``w2`` (down) ``[E, hidden, ffn]``; expert ``e`` computes
``(silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T`` on its contiguous run of tokens.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# DeepSpeed pads each expert's token run to this multiple for grouped GEMM kernels; the reference loop here
# needs no padding, but :func:`generate_permute_indices` keeps the contract for callers that do
TOKEN_GROUP_ALIGN_SIZE_M = 8


def _run_experts_for_loop(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, x: torch.Tensor,
                          num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Each expert on its run of rows of ``x``; rows past the counted ones (padding) come back as zeros."""
    counts = num_tokens_per_expert.tolist()
    counted = sum(counts)
    outputs = []
    for e, rows in enumerate(torch.split(x[:counted], counts, dim=0)):
        gate = F.silu(rows @ w1[e].to(x.dtype).transpose(0, 1))
        outputs.append((gate * (rows @ w3[e].to(x.dtype).transpose(0, 1))) @ w2[e].to(x.dtype).transpose(0, 1))
    out = torch.cat(outputs, dim=0) if outputs else x.new_zeros((0, w2.shape[1]))
    return torch.cat((out, out.new_zeros((x.shape[0] - counted, out.shape[-1]))), dim=0)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts of ``dim -> hidden_dim -> dim``.

    ``use_grouped_mm`` asks for ``torch._grouped_mm`` (one kernel for all experts); where that is not available
    (this torch on CPU) the constructor refuses with the fix rather than running something else. The loop over
    experts (``use_grouped_mm=False``) always works.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
                 disable_triton_grouped_mm: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        for weight in (self.w1, self.w2, self.w3):
            weight.is_expert_group = True  # Muon orthogonalises each expert's slice on its own
        self.use_triton_grouped_mm = False  # dsrun ships no Triton kernels
        self.use_grouped_mm = use_grouped_mm
        if use_grouped_mm and not hasattr(torch, "_grouped_mm"):
            raise RuntimeError("GroupedExperts was constructed with use_grouped_mm=True but torch._grouped_mm is not "
                               "available in this PyTorch build; set expert_parallel.use_grouped_mm=false to use the "
                               "sequential expert loop.")

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if not self.use_grouped_mm:
            return _run_experts_for_loop(self.w1, self.w2, self.w3, x, num_tokens_per_expert)
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        dtype = x.dtype
        gate = torch._grouped_mm(x, self.w1.to(dtype).transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(x, self.w3.to(dtype).transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(F.silu(gate) * up, self.w2.to(dtype).transpose(-2, -1), offs=offsets).type_as(x)


def generate_permute_indices(tokens_per_expert_group: torch.Tensor, experts_per_rank: int, num_ranks: int,
                             max_len: int, alignment: int, use_cpu: bool = False) -> tuple:
    """Where each row goes when rows received from ``num_ranks`` sources (each source's rows ordered by its
    ``experts_per_rank`` local experts, counts ``tokens_per_expert_group[r * E + e]``) are regrouped expert by
    expert, each expert's run padded to a multiple of ``alignment`` (at least ``alignment``).

    Returns ``(permuted_indices [max_len] int32, m_sizes [E] int32, m_offsets [E] int32)``: position ``i`` of the
    regrouped buffer takes source row ``permuted_indices[i]`` (-1 for padding), expert ``e`` owns ``m_sizes[e]``
    positions ending at ``m_offsets[e]``."""
    counts = tokens_per_expert_group.to(torch.int64).cpu()
    starts = torch.cumsum(counts, 0) - counts
    totals = counts.view(num_ranks, experts_per_rank).sum(0).clamp_min(alignment)
    m_sizes = ((totals + alignment - 1) // alignment * alignment)
    m_offsets = torch.cumsum(m_sizes, 0)
    permuted = torch.full((max_len, ), -1, dtype=torch.int32)
    for e in range(experts_per_rank):
        write = int(m_offsets[e] - m_sizes[e])
        for r in range(num_ranks):
            i = r * experts_per_rank + e
            n = min(int(counts[i]), max(max_len - write, 0))
            permuted[write:write + n] = torch.arange(int(starts[i]), int(starts[i]) + n, dtype=torch.int32)
            write += int(counts[i])
    device = tokens_per_expert_group.device
    return permuted.to(device), m_sizes.to(torch.int32).to(device), m_offsets.to(torch.int32).to(device)


def permute_by_local_expert(tokens: torch.Tensor,
                            local_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``tokens`` (grouped by source rank, then by local expert within each source; ``local_counts`` is
    ``[E_local]`` for one source or ``[sources, E_local]``) reordered so each local expert's rows are contiguous.

    Returns ``(tokens_permuted, permuted_indices, counts_per_expert, n_tokens)``; no padding rows are added
    (the expert loop needs none), so ``n_tokens == tokens_permuted.shape[0]``."""
    if local_counts.ndim not in (1, 2):
        raise ValueError(f"local_counts must have shape [E_local] or [ep_degree, E_local], got "
                         f"{tuple(local_counts.shape)}")
    by_source = local_counts.reshape(-1, local_counts.shape[-1]).to(torch.int64)
    expert_of_row = torch.arange(by_source.shape[1], device=tokens.device).repeat(by_source.shape[0])
    expert_of_row = torch.repeat_interleave(expert_of_row, by_source.reshape(-1).to(tokens.device))
    order = torch.argsort(expert_of_row, stable=True)
    return tokens[order], order, by_source.sum(0).to(torch.int32), tokens.shape[0]


def unpermute_by_local_expert(expert_output: torch.Tensor, permuted_indices: torch.Tensor,
                              n_tokens: int) -> torch.Tensor:
    """The inverse of :func:`permute_by_local_expert`: rows back in their received order."""
    out = expert_output.new_empty((n_tokens, expert_output.shape[-1]))
    out[permuted_indices] = expert_output[:n_tokens]
    return out
