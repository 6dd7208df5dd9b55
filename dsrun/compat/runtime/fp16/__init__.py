"""DeepSpeed's ``deepspeed.runtime.fp16`` package: the loss scaler is :mod:`dsrun.precision.loss_scaler`, the
1-bit optimizers :mod:`dsrun.optim.onebit`; ``fused_optimizer``/``unfused_optimizer`` name DeepSpeed's fp16
optimizer classes. A child is found through :data:`dsrun.alias.paths.PATHS` on first use."""
from dsrun.alias.paths import compat_attribute


def __getattr__(name: str):
    return compat_attribute("deepspeed.runtime.fp16", name)
