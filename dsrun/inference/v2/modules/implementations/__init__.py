"""``deepspeed.inference.v2.modules.implementations``: importing it registers the implementations: the FP6
and the fp16/bf16 linear, dense blocked attention, the layer/RMS pre- and post-norms, the multi-GEMM MoE. DeepSpeed's
package exposes each implementation's module by its own name (``implementations.cuda_post_ln``); here the three
norms share ``norms``, so those names are that module."""
from . import attention, linear, moe, norms
from .attention import DSDenseBlockedAttention
from .linear import BlasFPLinear, QuantizedWf6Af16Linear
from .moe import DSMultiGemmMoE
from .norms import DSPostLNCUDAModule, DSPreLNCUDAModule, DSPreRMSCUDAModule

dense_blocked_attention = attention
cutlass_multi_gemm = moe
cuda_post_ln = cuda_pre_ln = cuda_pre_rms = norms

__all__ = ["BlasFPLinear", "DSDenseBlockedAttention", "DSMultiGemmMoE", "DSPostLNCUDAModule", "DSPreLNCUDAModule",
           "DSPreRMSCUDAModule", "QuantizedWf6Af16Linear", "attention", "cuda_post_ln", "cuda_pre_ln", "cuda_pre_rms",
           "cutlass_multi_gemm", "dense_blocked_attention", "linear", "moe", "norms"]
