"""The engine core: :class:`~dsrun.engine.engine.DeepSpeedEngine` and :func:`~dsrun.engine.initialize.initialize`
(DeepSpeed's ``deepspeed.runtime.engine`` / ``deepspeed.initialize``), the observer, the data loader and the
direct-backward path. The strategies it composes live in their own rooms: :mod:`dsrun.precision`,
:mod:`dsrun.zero` (with :mod:`dsrun.offload` below it), :mod:`dsrun.optim`."""
