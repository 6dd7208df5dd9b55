"""DeepSpeed's ``deepspeed.runtime.comm`` package: of it dsrun serves ``coalesced_collectives``
(``dsrun/comm/coalesced.py``: ``reduce_scatter_coalesced``, ``all_to_all_quant_reduce``); its NCCL/MPI/HCCL
compressed backends are the 1-bit optimizers' (``dsrun/comm/compressed.py``)."""
