"""``deepspeed.runtime.tensor_parallel.config``: a Hugging Face model's tensor-parallel plan (home:
:mod:`dsrun.tensor_parallel.hf_plan`)."""
from dsrun.tensor_parallel.hf_plan import _get_hf_tp_plan

__all__ = ["_get_hf_tp_plan"]
