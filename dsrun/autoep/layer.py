"""AutoEP's MoE layer: a drop-in for a Hugging Face MoE block that holds only this rank's experts.

Forward: the router picks each token's top-k experts; the (token, slot) assignments are sorted by expert, sent
to the ranks owning those experts (one all-to-all of counts, then an all-to-all of rows), run through the local
experts, sent back, and summed per token weighted by the router's scores (``score_apply="post"``; ``"pre"``
scales the rows before the experts instead). Shared experts (Qwen, DeepSeek) are added on top.
"""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn as nn

from dsrun import comm as dist
from dsrun.autoep.experts import GroupedExperts, permute_by_local_expert, unpermute_by_local_expert  # noqa: F401
from dsrun.autoep.folding import mark_autoep_folding_router_parameter
from dsrun.autoep.presets import resolve_autoep_config_defaults
from dsrun.autoep.repack import _gather_source_zero_params, repack_expert_requires_grad_flags, repack_expert_weights
from dsrun.autoep.router import TokenChoiceTopKRouter, count_tokens_per_expert
from dsrun.autoep.spec import AutoEPConfig, MoELayerSpec


class RouterOutput(NamedTuple):
    top_scores: torch.Tensor  # [T, K]
    selected_experts: torch.Tensor  # [T, K]
    num_tokens_per_expert: torch.Tensor  # [E]


class SplitPlan(NamedTuple):
    """The token exchange of one forward: rows this rank sends to / receives from each EP rank, and the rows
    each local expert gets (in total and per source rank)."""
    input_splits: list[int]
    output_splits: list[int]
    local_counts: torch.Tensor  # [E_local]
    local_counts_by_source: torch.Tensor  # [ep_size, E_local]


def resolve_score_apply_mode(spec: MoELayerSpec, config_override: Literal["auto", "pre", "post"]) -> str:
    return spec.score_apply if config_override == "auto" else config_override


def resolve_combine_impl(config_override: Literal["auto", "weighted_sum", "legacy_bmm"]) -> str:
    return "weighted_sum" if config_override == "auto" else config_override


def _copy_parameter_data(target: nn.Parameter, source: torch.Tensor) -> None:
    """``target`` becomes a copy of ``source`` (its dtype and device too); the source must be whole (gathered)."""
    full_shape = torch.Size(getattr(source, "ds_shape", source.shape))
    with torch.no_grad():
        data = source.data
        if data.shape != full_shape:
            raise RuntimeError("AutoEP source parameter must be gathered before copying: expected full shape "
                               f"{tuple(full_shape)}, got {tuple(data.shape)}")
        if (target.data.shape, target.data.dtype, target.data.device) != (full_shape, data.dtype, data.device):
            target.data = torch.empty(full_shape, dtype=data.dtype, device=data.device)
        target.data.copy_(data)


def apply_scores_before_experts_if_enabled(routed_input: torch.Tensor, top_scores: torch.Tensor,
                                           score_apply: Literal["pre", "post"]) -> torch.Tensor:
    """With ``"pre"``, each routed row times its router score (in fp32); else the rows unchanged."""
    if score_apply == "pre":
        return (routed_input.to(torch.float32) * top_scores.reshape(-1, 1)).to(routed_input.dtype)
    return routed_input


def _split_plan_from_expert_counts(num_tokens_per_expert: torch.Tensor, ep_size: int, num_local_experts: int,
                                   ep_group) -> SplitPlan:
    """One all-to-all of the ``[ep_size, E_local]`` count matrix: row ``s`` received is what source ``s`` sends
    to this rank's experts, so both split lists and the per-expert counts follow from it."""
    sent = num_tokens_per_expert.view(ep_size, num_local_experts)
    received = torch.empty_like(sent.reshape(-1).contiguous())
    dist.all_to_all_single(received, sent.reshape(-1).contiguous(), group=ep_group)
    received = received.view(ep_size, num_local_experts)
    input_splits, output_splits = torch.stack((sent.sum(dim=1), received.sum(dim=1))).cpu().tolist()
    return SplitPlan(input_splits, output_splits, received.sum(dim=0), received)


def compute_split_plan(selected_experts: torch.Tensor, num_experts: int, ep_size: int, num_local_experts: int,
                       ep_group, num_tokens_per_expert: torch.Tensor | None = None) -> SplitPlan:
    """The exchange for ``selected_experts`` (``[T, K]``; its histogram may be passed when already counted)."""
    if num_tokens_per_expert is None:
        num_tokens_per_expert = count_tokens_per_expert(selected_experts, num_experts)
    if ep_size == 1:
        rows = selected_experts.numel()
        return SplitPlan([rows], [rows], num_tokens_per_expert, num_tokens_per_expert.view(1, num_local_experts))
    return _split_plan_from_expert_counts(num_tokens_per_expert, ep_size, num_local_experts, ep_group)


def compute_split_plan_from_expert_indices(expert_indices: torch.Tensor, num_experts: int, ep_size: int,
                                           num_local_experts: int, ep_group) -> SplitPlan:
    """The exchange for a flat list of assignments' experts (the folded path's share of them)."""
    return compute_split_plan(expert_indices, num_experts, ep_size, num_local_experts, ep_group)


class _AllToAllV(torch.autograd.Function):
    """All-to-all of rows with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, group, x, input_splits, output_splits):
        ctx.group, ctx.input_splits, ctx.output_splits = group, input_splits, output_splits
        out = x.new_empty((sum(output_splits), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.input_splits), grad_out.shape[1]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes=ctx.input_splits,
                               input_split_sizes=ctx.output_splits, group=ctx.group)
        return None, grad_in, None, None


def combine_from_routed(expert_output: torch.Tensor, top_scores: torch.Tensor, token_indices_sorted: torch.Tensor,
                        top_k: int, score_apply: Literal["pre", "post"],
                        combine_impl: Literal["weighted_sum", "legacy_bmm"], shape: tuple[int, int, int]) -> torch.Tensor:
    """Per token, the sum over its ``top_k`` slots of the expert outputs (weighted by ``top_scores`` with
    ``"post"``); ``expert_output`` row ``i`` belongs to flat slot ``token_indices_sorted[i]``."""
    bsz, seqlen, hdim = shape
    tokens = bsz * seqlen
    slots = expert_output.new_zeros((tokens * top_k, hdim))
    slots[token_indices_sorted] = expert_output
    slots = slots.reshape(tokens, top_k, hdim)
    if score_apply != "post":
        out = slots.sum(dim=1)
    elif combine_impl == "legacy_bmm":
        out = torch.bmm(top_scores.reshape(-1, 1, top_k).float(), slots.float()).squeeze(1).to(expert_output.dtype)
    else:
        out = (slots.float() * top_scores.reshape(tokens, top_k, 1).float()).sum(dim=1).to(expert_output.dtype)
    return out.reshape(bsz, seqlen, hdim)


class AutoEPMoELayer(nn.Module):
    """The replacement for one MoE block (``spec``, copied from ``source_module``) holding experts
    ``[ep_rank * E/ep_size, (ep_rank + 1) * E/ep_size)``."""

    _is_autoep_layer = True  # AutoTP leaves these layers alone

    def __init__(self, spec: MoELayerSpec, source_module: nn.Module, ep_size: int, ep_rank: int,
                 config: AutoEPConfig) -> None:
        super().__init__()
        self.model_family = spec.model_family
        self.return_router_logits = spec.return_router_logits
        self.router_logits_capture_target = spec.router_logits_capture_target
        self.router_logits_capture_index = spec.router_logits_capture_index
        self.router_logits_capture_mode = spec.router_logits_capture_mode
        self.moe_output_shape = spec.moe_output_shape
        self.top_k = spec.top_k
        self.score_apply = resolve_score_apply_mode(spec, config.score_apply)
        self.combine_impl = resolve_combine_impl(config.combine_impl)
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_experts = spec.num_experts
        self.num_local_experts = spec.num_experts // ep_size
        self.hidden_size = spec.hidden_size
        self.ep_group_name = f"ep_size_{ep_size}"
        self.ep_group = None  # bound by set_deepspeed_parallelism
        self.folding_group_handles = None
        self.tp_group = None
        resolved = resolve_autoep_config_defaults(config, spec.model_family)
        self.validate_folding_routing = bool(resolved.validate_folding_routing)

        gate = getattr(source_module, spec.router_name)
        gate_bias = getattr(gate, "bias", None)
        correction = getattr(gate, "e_score_correction_bias", None)
        other_biases = [getattr(gate, name, None) for name in spec.unsupported_router_bias_names]
        if not spec.supports_expert_bias and resolved.load_balance_coeff is not None:
            raise ValueError(f"AutoEP preset '{spec.model_family}' does not support load_balance_coeff/expert_bias "
                             "yet. Set load_balance_coeff=None.")
        with _gather_source_zero_params([gate.weight, gate_bias, correction, *other_biases]):
            for name, bias in zip(spec.unsupported_router_bias_names, other_biases):
                if bias is not None and not (torch.is_tensor(bias) and not torch.count_nonzero(bias.detach())):
                    raise ValueError(f"AutoEP preset '{spec.model_family}' does not support nonzero router bias "
                                     f"'{name}' yet.")
            self.router = TokenChoiceTopKRouter(
                dim=spec.hidden_size, num_experts=spec.num_experts, num_expert_groups=spec.num_expert_groups,
                num_limited_groups=spec.num_limited_groups, top_k=spec.top_k, score_func=spec.score_func,
                route_norm=spec.route_norm if config.route_norm is None else config.route_norm,
                route_scale=spec.route_scale, gate_bias=spec.gate_bias, group_score_func=spec.group_score_func)
            _copy_parameter_data(self.router.gate.weight, gate.weight)
            self.router.gate.weight.requires_grad_(gate.weight.requires_grad)
            if spec.gate_bias and gate_bias is not None:
                _copy_parameter_data(self.router.gate.bias, gate_bias)
                self.router.gate.bias.requires_grad_(gate_bias.requires_grad)
            if isinstance(correction, nn.Parameter):
                self.router.e_score_correction_bias = nn.Parameter(correction.data.clone(),
                                                                   requires_grad=correction.requires_grad)

        # Transformers' recorder may look for the router under the block's own name for it ("gate")
        alias = spec.router_logits_capture_layer_name or spec.router_name
        if (spec.router_logits_capture_target == "router" and alias != "router" and "." not in alias
                and alias not in ("experts", "shared_experts") and not hasattr(self, alias)):
            setattr(self, alias, self.router)

        experts_source = getattr(source_module, spec.experts_name)
        w1, w2, w3 = repack_expert_weights(experts_source, spec, ep_rank=ep_rank, ep_size=ep_size)
        grads = repack_expert_requires_grad_flags(experts_source, spec, ep_rank=ep_rank, ep_size=ep_size)
        self.experts = GroupedExperts(dim=spec.hidden_size, hidden_dim=spec.ffn_hidden_size,
                                      num_experts=self.num_local_experts, use_grouped_mm=config.use_grouped_mm,
                                      disable_triton_grouped_mm=config.disable_triton_grouped_mm)
        for weight, source, requires_grad in zip((self.experts.w1, self.experts.w2, self.experts.w3), (w1, w2, w3),
                                                 grads):
            _copy_parameter_data(weight, source)
            weight.requires_grad_(requires_grad)

        self.shared_experts = getattr(source_module, spec.shared_experts_name, None) if spec.has_shared_experts else None
        self.shared_experts_gate = (getattr(source_module, spec.shared_experts_gate_name, None)
                                    if spec.shared_experts_gate_name else None)

        # expert weights reduce over their expert-data-parallel group (as DeepSpeed's MoE experts do); the rest
        # over the whole data-parallel group
        for param in self.experts.parameters():
            param.allreduce = False
            param.group_name = self.ep_group_name
            param.ds_zero_placement_family = "autoep_expert"
            param.ds_zero_partition_group_name = self.ep_group_name
        for param in self.router.parameters():
            param.allreduce = True
            mark_autoep_folding_router_parameter(param)
            param.ds_zero_placement_family = "replicated"
        for module in (self.shared_experts, self.shared_experts_gate):
            for param in module.parameters() if module is not None else ():
                param.allreduce = True
                param.ds_zero_placement_family = "replicated"

        self.load_balance_coeff = resolved.load_balance_coeff
        device = gate.weight.device
        self.expert_bias = None  # load_balance_coeff is refused at parse time: no auxiliary-loss-free balancing
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts, dtype=torch.float32, device=device),
                             persistent=False)
        self._cached_router_logits = None
        if self.router_logits_capture_target == "router":
            self.router.register_forward_hook(self._cache_router_logits)

    def _cache_router_logits(self, router: nn.Module, inputs, output) -> None:
        logits = router.gate(inputs[0])
        if self.router_logits_capture_mode == "post_score":
            activation = torch.softmax if router.score_func == "softmax" else None
            if activation is not None:
                logits = activation(logits.float(), dim=-1).to(logits.dtype)
            elif router.score_func == "sigmoid":
                logits = torch.sigmoid(logits.float()).to(logits.dtype)
        self._cached_router_logits = logits

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  folding_group_handles=None) -> None:
        """Bind the expert-parallel group (created by name if it does not exist yet)."""
        from dsrun.moe import groups

        if folding_group_handles is not None:
            if folding_group_handles.spec.tp_size > 1:
                raise NotImplementedError("AutoEP layers folded over AutoTP (tensor_parallel.autotp_size > 1) are not "
                                          "supported by dsrun yet; use tensor_parallel.autotp_size=1 with AutoEP.")
            self.folding_group_handles = folding_group_handles
            self.ep_group_name = folding_group_handles.ep_group_name
            self.ep_group = folding_group_handles.ep_group
            self.tp_group = folding_group_handles.tp_group
            self.ep_rank = dist.get_rank(group=self.ep_group)
            return
        if self.ep_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size, use_data_before_expert_parallel_)
        self.ep_group = groups._get_expert_parallel_group(self.ep_group_name)

    def forward(self, hidden_states: torch.Tensor):
        bsz, seqlen, hdim = hidden_states.shape
        x = hidden_states.reshape(-1, hdim)
        routed = RouterOutput(*self.router(x, self.expert_bias))
        with torch.no_grad():
            self.tokens_per_expert.add_(routed.num_tokens_per_expert)

        # flat (token, slot) assignments in expert order; slot i belongs to token i // top_k
        slot_order = torch.argsort(routed.selected_experts.view(-1), stable=True)
        scores_sorted = routed.top_scores.view(-1)[slot_order]
        rows = apply_scores_before_experts_if_enabled(x[slot_order // self.top_k], scores_sorted, self.score_apply)

        if self.ep_size == 1:
            permuted, order, counts, n = permute_by_local_expert(rows, routed.num_tokens_per_expert)
            expert_output = unpermute_by_local_expert(self.experts(permuted, counts), order, n)
        else:
            plan = compute_split_plan(routed.selected_experts, self.num_experts, self.ep_size, self.num_local_experts,
                                      self.ep_group, num_tokens_per_expert=routed.num_tokens_per_expert)
            received = _AllToAllV.apply(self.ep_group, rows, plan.input_splits, plan.output_splits)
            permuted, order, counts, n = permute_by_local_expert(received, plan.local_counts_by_source)
            expert_output = unpermute_by_local_expert(self.experts(permuted, counts), order, n)
            expert_output = _AllToAllV.apply(self.ep_group, expert_output, plan.output_splits, plan.input_splits)

        output = combine_from_routed(expert_output, routed.top_scores, slot_order, self.top_k, self.score_apply,
                                     self.combine_impl, (bsz, seqlen, hdim))
        shared_input = hidden_states
        if self.moe_output_shape == "flat":
            output = output.reshape(-1, hdim)
            shared_input = x
        elif self.shared_experts_gate is not None:
            shared_input = x
        if self.shared_experts is not None:
            shared = self.shared_experts(shared_input)
            if self.shared_experts_gate is not None:
                shared = torch.sigmoid(self.shared_experts_gate(shared_input)) * shared
            output = output + shared.reshape_as(output)

        logits, self._cached_router_logits = self._cached_router_logits, None
        return (output, logits) if self.return_router_logits else output
