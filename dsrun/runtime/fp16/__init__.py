"""DeepSpeed's ``deepspeed.runtime.fp16`` module paths; dsrun keeps the communication-efficient optimizers
here (:mod:`.onebit`). Mixed precision itself is :mod:`dsrun.runtime.precision`."""
