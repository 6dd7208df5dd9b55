"""``deepspeed.module_inject.tp_plan_converter``: a Hugging Face tp_plan as AutoTP layer specs (home:
:mod:`dsrun.tensor_parallel.hf_plan`)."""
from dsrun.tensor_parallel.hf_plan import TPPlanConverter

__all__ = ["TPPlanConverter"]
