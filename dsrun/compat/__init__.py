"""DeepSpeed's module paths whose modules only re-export: each file mirrors its DeepSpeed path under
``dsrun/compat/`` (``deepspeed.runtime.zero.stage_1_and_2`` is ``dsrun/compat/runtime/zero/stage_1_and_2.py``)
and :data:`dsrun.alias.paths.PATHS` names it. dsrun's own code never imports from here."""
