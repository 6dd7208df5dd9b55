"""DeepSpeed's ``deepspeed.runtime`` package. Its rooms live in dsrun's own folders (the engine in
:mod:`dsrun.engine`, ZeRO in :mod:`dsrun.zero`, offload in :mod:`dsrun.offload`, ...); a child is found through
:data:`dsrun.alias.paths.PATHS` on first use, so ``import dsrun as deepspeed; deepspeed.runtime.lr_schedules``
works too."""
from dsrun.alias.paths import compat_attribute


def __getattr__(name: str):
    return compat_attribute("deepspeed.runtime", name)
