"""Activation checkpointing: keep a function's inputs, recompute its activations in backward.

The room behind ``dsrun.checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``): :mod:`.settings` (what
``configure`` set), :mod:`.rng` (random states, the model-parallel tracker), :mod:`.storage` (partitioned,
host and contiguous inputs), :mod:`.checkpoint` (reentrant and non-reentrant), :mod:`.selective` (keep the
expensive outputs), :mod:`.modes` (which blocks of a model, ``none | full | every_N | selective``).
"""
