"""DeepSpeed's ``deepspeed.runtime.zenflow`` package (dsrun's ZenFlow: :mod:`dsrun.zero.zenflow`, the feature, and
:mod:`dsrun.offload.zenflow_store`, the algorithm; docs/zenflow.md)."""
