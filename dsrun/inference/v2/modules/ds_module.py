"""DeepSpeed's inference-v2 module machinery (``deepspeed.inference.v2.modules.ds_module`` and
``module_registry``): a module is built from its config by name through the registry of its interface."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Type

import torch

from dsrun.config.config_utils import DeepSpeedConfigModel


class DSModuleConfig(DeepSpeedConfigModel):
    max_tokens: int


class DSModuleBase(torch.nn.Module, ABC):
    """An inference module: ``name()`` is its registry key, ``supports_config(config)`` whether it can run that
    configuration, ``config_class()`` (on the interface) the config it takes."""

    @staticmethod
    @abstractmethod
    def name() -> str:
        ...

    @staticmethod
    @abstractmethod
    def config_class() -> Type[DSModuleConfig]:
        ...

    @staticmethod
    @abstractmethod
    def supports_config(config: DSModuleConfig) -> bool:
        ...

    def __init__(self, config: DSModuleConfig, implementation_config: Dict[str, Any] = {}) -> None:  # noqa: B006
        super().__init__()
        self._config = config
        self._implementation_config = implementation_config


class ConfigBundle(DeepSpeedConfigModel):
    """Which implementation (``name``) to build with which ``config``."""
    name: str
    config: DeepSpeedConfigModel
    implementation_config: Dict[str, Any] = {}


class DSModuleRegistryBase(ABC):
    """The implementations of one interface, by name (each interface's registry has its own ``registry`` dict)."""
    registry: Dict[str, Type[DSModuleBase]]

    @classmethod
    def instantiate_config(cls, config_bundle: ConfigBundle) -> DSModuleBase:
        if config_bundle.name not in cls.registry:
            raise KeyError(f"Unknown DSModule: {config_bundle.name}, cls.registry={cls.registry}")
        implementation = cls.registry[config_bundle.name]
        if not implementation.supports_config(config_bundle.config):
            raise ValueError(f"Config {config_bundle.config} is not supported by {implementation}")
        return implementation(config_bundle.config, config_bundle.implementation_config)

    @staticmethod
    @abstractmethod
    def associated_class() -> Type[DSModuleBase]:
        raise NotImplementedError("Must associated a DSModule class with its registry.")

    @classmethod
    def register_module(cls, child_class: Type[DSModuleBase]) -> Type[DSModuleBase]:
        if not issubclass(child_class, cls.associated_class()):
            raise TypeError(f"Can only register subclasses of {cls.associated_class()}, {child_class} does not "
                            f"inherit from {cls.associated_class()}")
        cls.registry[child_class.name()] = child_class
        return child_class
