"""DeepSpeed's ``deepspeed.runtime.sequence_parallel`` package: ``ulysses_sp`` (ALST: the tiled compute and Ulysses
for Hugging Face models, ``ulysses_sp.py`` here) and ``parallel_state_sp`` (the sequence-parallel mpu,
``dsrun/sequence/parallel_state_sp.py``)."""
