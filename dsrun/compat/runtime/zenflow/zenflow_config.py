"""``deepspeed.runtime.zenflow.zenflow_config``: ``ZenFlowConfig``, the ``zero_optimization.zenflow`` section
(home: :mod:`dsrun.config.recent`)."""
from dsrun.config.recent import ZenFlowConfig

__all__ = ["ZenFlowConfig"]
