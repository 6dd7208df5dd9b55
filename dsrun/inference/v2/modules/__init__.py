"""``deepspeed.inference.v2.modules``: inference modules built by name from their configs (``ConfigBundle``,
the interfaces' registries), and the implementations dsrun has."""
from . import configs, interfaces
from . import implementations
from .ds_module import ConfigBundle, DSModuleBase, DSModuleConfig, DSModuleRegistryBase

__all__ = ["ConfigBundle", "DSModuleBase", "DSModuleConfig", "DSModuleRegistryBase", "configs", "implementations",
           "interfaces"]
