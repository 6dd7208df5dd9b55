"""DeepSpeed's ``deepspeed.compile.custom_ops`` package: ``tp_collectives`` is AutoTP's graph collectives,
:mod:`dsrun.tensor_parallel.graph_collectives` (AutoSP's all-to-all ops are not in dsrun). A child is found through
:data:`dsrun.alias.paths.PATHS` on first use."""
from dsrun.alias.paths import compat_attribute


def __getattr__(name: str):
    return compat_attribute("deepspeed.compile.custom_ops", name)
