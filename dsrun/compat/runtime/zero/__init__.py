"""DeepSpeed-named modules of ``deepspeed.runtime.zero`` that only re-export (the package itself is
:mod:`dsrun.zero`)."""
