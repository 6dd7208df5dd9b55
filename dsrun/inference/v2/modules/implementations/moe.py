"""DeepSpeed's ``cutlass_multi_gemm_moe``: the MoE layer on the torch ragged kernels. The gate (``gate_w``
[experts, model_dim]) scores each token, :class:`RaggedTopKGating` picks its ``top_k`` experts,
:class:`MoEScatter` groups the tokens by expert, :class:`MoEGEMM` runs each expert's two linears (a gated
activation between them applied by :class:`CUDAGatedActivation`), :class:`MoEGather` puts the outputs back in
token order weighted by the gate scores. Expert weights are given [experts, out, in] and stored [experts, in, out]
(``implementation_config['weight_dtype']`` is their dtype)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ...allocator import current_device, empty_from
from ...inference_parameter import InferenceParameter
from ...inference_utils import ActivationType, DtypeEnum, is_gated
from ...kernels.core_ops import BlasLibLinear, CUDAGatedActivation
from ...kernels.cutlass_ops import MoEGEMM
from ...kernels.ragged_ops import MoEGather, MoEScatter, RaggedTopKGating
from ...ragged import RaggedBatchWrapper
from ..configs import DSMoEConfig
from ..interfaces import DSMoEBase, DSMoERegistry


@DSMoERegistry.register_module
class DSMultiGemmMoE(DSMoEBase):

    @staticmethod
    def name() -> str:
        return 'cutlass_multi_gemm_moe'

    @staticmethod
    def supports_config(config: DSMoEConfig) -> bool:
        if config.input_dtype != config.output_dtype:
            return False
        if DtypeEnum(config.input_dtype) not in (DtypeEnum.fp16, DtypeEnum.bf16):
            return False
        return config.top_k in (1, 2, 4, 8)

    def __init__(self, config: DSMoEConfig, implementation_config: Dict[str, Any]) -> None:
        super().__init__(config, implementation_config)
        self.max_tokens = config.max_tokens
        self.n_experts = config.n_experts
        self.n_top_k = config.top_k
        self.intermediate_dim = config.intermediate_features
        gated = is_gated(config.activation)
        weight_dtype = implementation_config['weight_dtype']
        self._mlp_1 = MoEGEMM(fp_dtype=weight_dtype, act_fn=ActivationType.IDENTITY if gated else config.activation)
        self._mlp_2 = MoEGEMM(fp_dtype=weight_dtype, act_fn=ActivationType.IDENTITY)
        self._activation = (CUDAGatedActivation(config.model_dim, config.input_dtype, config.activation)
                            if gated else None)
        self._gate_proj = BlasLibLinear(config.input_dtype)
        self._top_1_gate = RaggedTopKGating(config.input_dtype)
        self._moe_scatter = MoEScatter(config.input_dtype, config.model_dim)
        self._moe_gather = MoEGather(config.input_dtype, config.model_dim, config.normalize_scores)
        self._create_buffers()

    def _create_buffers(self) -> None:
        config, device, k = self._config, current_device(), self.n_top_k
        rows = config.max_tokens * k
        self._logits = torch.empty((config.max_tokens, self.n_experts), dtype=config.input_dtype, device=device)
        self._expert_counts = torch.empty((self.n_experts, ), dtype=torch.int32, device=device)
        self._scores = torch.empty((config.max_tokens, k), dtype=torch.float32, device=device)
        self._assignments = torch.empty((config.max_tokens, k), dtype=torch.int32, device=device)
        self._offsets = torch.empty((config.max_tokens, k), dtype=torch.int32, device=device)
        self._moe_input = torch.empty((rows, config.model_dim), dtype=config.input_dtype, device=device)
        self._expert_cumsum = torch.empty((self.n_experts, ), dtype=torch.int64, device=device)
        self._mapped_slots = torch.empty((config.max_tokens, k), dtype=torch.int32, device=device)
        self._intermediate = torch.empty((rows, config.intermediate_features), dtype=config.output_dtype,
                                         device=device)
        if self._activation is not None:
            self._gated_intermediate = torch.empty((rows, config.intermediate_features * 2),
                                                   dtype=config.output_dtype, device=device)
        self._output_unordered = torch.empty((rows, config.model_dim), dtype=config.output_dtype, device=device)
        self._output = torch.empty((config.max_tokens, config.model_dim), dtype=config.output_dtype, device=device)

    def transform_gate_param(self, param: torch.Tensor) -> InferenceParameter:
        return InferenceParameter.initialize(param.to(self._config.input_dtype))

    def transform_moe_mlp_1_param(self, param: torch.Tensor) -> InferenceParameter:
        param = param.to(self._config.input_dtype)
        if param.dim() == 3:
            param = param.permute(0, 2, 1).contiguous()
        return InferenceParameter.initialize(param)

    transform_moe_mlp_2_param = transform_moe_mlp_1_param

    @property
    def output(self) -> torch.Tensor:
        return self._output

    def _gate(self, hidden_states: torch.Tensor, batch: RaggedBatchWrapper,
              gate_w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, k = hidden_states.shape[0], self.n_top_k
        logits = empty_from(self._logits, (tokens, self.n_experts))
        scores = empty_from(self._scores, (tokens, k))
        assignments = empty_from(self._assignments, (tokens, k))
        offsets = empty_from(self._offsets, (tokens, k))
        mapped_slots = empty_from(self._mapped_slots, (tokens, k))
        moe_input = empty_from(self._moe_input, (tokens * k, self._moe_input.shape[-1]))
        self._gate_proj(logits, hidden_states, gate_w)
        self._expert_counts.zero_()
        self._top_1_gate(self._expert_counts, scores, assignments, offsets, logits, batch)
        self._moe_scatter(moe_input, self._expert_cumsum, mapped_slots, hidden_states, self._expert_counts,
                          assignments, offsets)
        return moe_input, self._expert_cumsum, scores, mapped_slots

    def forward(self, hidden_states: torch.Tensor, batch_metadata: RaggedBatchWrapper, gate_w: torch.Tensor,
                mlp_1_w: torch.Tensor, mlp_2_w: torch.Tensor, mlp_1_b: Optional[torch.Tensor] = None,
                mlp_2_b: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden_states`` [tokens, model_dim] -> [tokens, model_dim] (a view of the module's buffer)."""
        moe_input, expert_cumsum, scores, mapped_slots = self._gate(hidden_states, batch_metadata, gate_w)
        rows = hidden_states.shape[0] * self.n_top_k
        intermediate = empty_from(self._intermediate, (rows, self._intermediate.shape[-1]))
        output_unordered = empty_from(self._output_unordered, (rows, self._output_unordered.shape[-1]))
        output = empty_from(self._output, (hidden_states.shape[0], self._output.shape[-1]))
        if self._activation is not None:
            gated = empty_from(self._gated_intermediate, (rows, self._gated_intermediate.shape[-1]))
            self._mlp_1(gated, moe_input, mlp_1_w, expert_cumsum, mlp_1_b)
            self._activation(intermediate, gated)
        else:
            self._mlp_1(intermediate, moe_input, mlp_1_w, expert_cumsum, mlp_1_b)
        self._mlp_2(output_unordered, intermediate, mlp_2_w, expert_cumsum, mlp_2_b)
        self._moe_gather(output, output_unordered, scores, mapped_slots, self._expert_counts)
        return output
