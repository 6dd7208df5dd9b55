"""DeepSpeed-named modules of ``deepspeed.ops`` that only re-export (the package itself is :mod:`dsrun.ops`)."""
