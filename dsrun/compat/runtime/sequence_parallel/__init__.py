"""DeepSpeed's ``deepspeed.runtime.sequence_parallel`` package: of its ``ulysses_sp`` module dsrun serves the tiled
compute (``dsrun/sequence/tiled_compute.py``: ``TiledMLP``, ``sequence_tiled_compute``, ``TiledFusedLogitsLoss``)."""
