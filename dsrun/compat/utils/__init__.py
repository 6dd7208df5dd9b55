"""DeepSpeed-named modules of ``deepspeed.utils`` that only re-export (the package itself is :mod:`dsrun.utils`)."""
