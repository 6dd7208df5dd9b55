"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` section and its defaults
(their home is :mod:`dsrun.config.recent`; the flags themselves are :mod:`dsrun.utils.leaf_modules`)."""
from dsrun.config.recent import (DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
                                 DEFAULT_LEAF_MODULE_NAMES)
from dsrun.config.recent import LeafModuleConfig as DeepSpeedZeroLeafModuleConfig

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroLeafModuleConfig"]
