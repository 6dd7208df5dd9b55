"""``deepspeed.inference.v2.model_implementations.layer_container_base``: a layer's parameters, filled from a
checkpoint by name. A ``LayerContainer`` subclass annotates its parameters (``ParameterBase`` subclasses) and maps
checkpoint names to their dependencies in ``PARAM_MAPPING`` (``"model.layers.*.mlp.w"`` with one ``*`` for a
parameter list's index; one name may feed several dependencies). The mapping is checked when the class is made:
every dependency mapped exactly once, every target existing, else ValueError."""
from __future__ import annotations

import re
from typing import Any

import torch

from ..allocator import current_device
from ..inference_parameter import InferenceParameter
from .parameter_base import MAPPING_KEY, ParameterBase, ParametrizedList, annotations_of_namespace

PLIST_HELPERS = "_ds_plist_strip_vals"


def _parameters_of(annotations: dict[str, Any]) -> list[str]:
    return [name for name, kind in annotations.items() if isinstance(kind, type) and issubclass(kind, ParameterBase)]


class LayerMetaclass(type):

    def __new__(mcs, clsname, bases, attrs):
        annotations = annotations_of_namespace(attrs)
        for base in bases:  # parameters and mappings of base containers are shared by the subclass
            annotations.update(getattr(base, "_ds_annotations", {}))
            if hasattr(base, MAPPING_KEY):
                attrs[MAPPING_KEY] = {**attrs.get(MAPPING_KEY, {}), **getattr(base, MAPPING_KEY)}
        names = _parameters_of(annotations)
        if MAPPING_KEY in attrs:
            attrs[PLIST_HELPERS] = _check_mapping(clsname, attrs[MAPPING_KEY], annotations, names)
        attrs["finalization_callback"] = _finalization_callback(names)
        cls = super().__new__(mcs, clsname, bases, attrs)
        cls._ds_annotations = annotations
        cls._n_params = len(names)
        cls._annotation_attrs = names
        return cls

    def __call__(cls, *args, **kwargs):
        instance = super().__call__(*args, **kwargs)
        for name in cls._annotation_attrs:
            setattr(instance, name, cls._ds_annotations[name](instance.inference_model, instance))
        return instance


def _check_mapping(clsname: str, mapping: dict, annotations: dict, names: list[str]) -> list:
    """Validate ``mapping`` against the parameters' dependencies; the (prefix, suffix, targets) of each wildcard
    rule that feeds parameter lists."""
    unmapped = {f"{name}.{dep}" for name in names for dep, kind in annotations[name]._ds_dependencies.items()}
    plist_rules = []
    for source, targets in mapping.items():
        targets = [targets] if isinstance(targets, str) else list(targets)
        kinds = []
        for target in targets:
            param, dependency = target.split(".")
            if param not in names:
                raise ValueError(f"Target parameter \"{param}\" not found in this layer. Valid targets are {names}")
            dependencies = annotations[param]._ds_dependencies
            if dependency not in dependencies:
                raise ValueError(f"Target dependency \"{dependency}\" not found on parameter \"{param}\". Valid "
                                 f"targets are {list(dependencies)}")
            if target not in unmapped:
                raise ValueError(f"Target dependency \"{target}\" was targeted with multiple mapping rules.")
            unmapped.remove(target)
            kinds.append(dependencies[dependency])
        are_lists = [issubclass(kind, ParametrizedList) for kind in kinds]
        if all(are_lists):
            if source.count("*") != 1:
                raise ValueError(f"A ParametrizedList mapping needs exactly one wildcard (*) in its source name: "
                                 f"{source}")
            prefix, suffix = source.split("*")
            plist_rules.append((prefix, suffix, targets))
        elif any(are_lists):
            raise ValueError("Cannot mix ParametrizedLists and Tensors in a single mapping rule.")
    if unmapped:
        raise ValueError(f"A parameter mapping was provided for {clsname}, but the following dependencies were not "
                         f"mapped: {unmapped}")
    return plist_rules


def _finalization_callback(names: list[str]):
    def finalization_callback(self, param: ParameterBase, finalized: torch.Tensor) -> None:
        self._finalized_params += 1
        for name in names:
            if getattr(self, name) is param:
                setattr(self, name, finalized)
    return finalization_callback


class LayerContainer(metaclass=LayerMetaclass):
    """The parameters of one layer (or of the parts outside the layers); each ``ParameterBase`` is replaced by its
    finished tensor as soon as its dependencies are set."""

    def __init__(self, model: object) -> None:
        self.inference_model = model
        self._finalized_params = 0

    def _initialization_checker(self, check_device: bool = True) -> bool:
        if self._finalized_params != self.n_params:
            return False
        device = current_device()
        for name in self._annotation_attrs:
            tensor = getattr(self, name)
            if tensor is None:
                continue
            if not isinstance(tensor, InferenceParameter):
                raise ValueError(f"Layer should be finalized, but {name} ({type(tensor)}) is neither "
                                 "InferenceParameter or None")
            if check_device and tensor.device != device:
                raise RuntimeError(f"Layer should be finalized, but {name} is not on device {device}")
        return True

    @property
    def is_populated(self) -> bool:
        """Every parameter finished (its device not checked)."""
        return self._initialization_checker(check_device=False)

    @property
    def is_initialized(self) -> bool:
        """Every parameter finished and on the accelerator's device."""
        return self._initialization_checker()

    @property
    def n_params(self) -> int:
        return self._n_params

    @property
    def annotation_attrs(self) -> list:
        return self._annotation_attrs

    @property
    def mapping_params(self) -> dict:
        return getattr(type(self), MAPPING_KEY, {})

    @property
    def plist_helpers(self) -> list:
        return getattr(type(self), PLIST_HELPERS, [])

    def direct_injection(self, name: str, tensor: InferenceParameter) -> None:
        if name not in self._annotation_attrs:
            raise ValueError(f"Cannot directly inject {name}, not a valid parameter.")
        setattr(self, name, tensor)
        self._finalized_params += 1

    def set_dependency(self, dep_name: str, dep_value: torch.Tensor) -> None:
        """Give the checkpoint tensor ``dep_name`` (its layer prefix removed) to the dependencies it maps to: an
        exact name first, then a parameter list's wildcard rule, then any other wildcard rule."""
        if dep_name in self.mapping_params:
            return self._set_targets(self.mapping_params[dep_name], dep_value)
        for prefix, suffix, targets in self.plist_helpers:
            if dep_name.startswith(prefix) and dep_name.endswith(suffix):
                index = int(dep_name[len(prefix):len(dep_name) - len(suffix)])
                for target in targets:
                    param, dependency = target.split(".")
                    getattr(getattr(self, param), dependency)[index] = dep_value
                return
        matched = [target for key, target in self.mapping_params.items()
                   if re.match(key.replace("*", ".*"), dep_name)]
        if len(matched) > 1:
            raise ValueError(f"Multiple targets matched for dependency {dep_name}: {matched}")
        if matched:
            return self._set_targets(matched[0], dep_value)
        raise ValueError(f"Could not find a mapping for dependency \"{dep_name}\". Check that it is included in the "
                         f"``PARAM_MAPPING`` of {type(self).__name__}.")

    def _set_targets(self, targets, value: torch.Tensor) -> None:
        for target in [targets] if isinstance(targets, str) else targets:
            param, dependency = target.split(".")
            setattr(getattr(self, param), dependency, value)


__all__ = ["LayerContainer", "LayerMetaclass"]
