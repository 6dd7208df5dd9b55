"""``deepspeed.inference.v2.model_implementations.parameter_base``: a parameter assembled from the checkpoint
tensors it depends on. A ``ParameterBase`` subclass declares its dependencies as annotations (``torch.Tensor``, or a
``ParamList("count_attr")`` of as many tensors as the inference model's ``count_attr``); once every one is set,
``finalize()`` builds the parameter and the owning layer container swaps it in."""
from __future__ import annotations

import sys
import weakref
from abc import abstractmethod
from typing import Any, Mapping

import torch

MAPPING_KEY = "PARAM_MAPPING"


def annotations_of_namespace(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The annotations a class body declared (Python 3.14 evaluates them lazily, through ``annotationlib``)."""
    if sys.version_info >= (3, 14):
        import annotationlib
        annotate = annotationlib.get_annotate_from_class_namespace(namespace)
        if annotate is not None:
            return dict(annotationlib.call_annotate_function(annotate, annotationlib.Format.VALUE))
    return dict(namespace.get("__annotations__", {}))


class ParametrizedList:
    """A dependency of a variable number of tensors (a MoE layer's experts), indexed ``experts[i]``; it counts as
    one dependency of its parameter, complete when all ``n_params`` are set. ``torch.cat(tuple(plist))`` to
    concatenate. Subclasses name the inference model's attribute with the count as ``count_attr``."""
    count_attr: str

    def __init__(self, param: "ParameterBase", n_params: int) -> None:
        self.n_params = n_params
        self.set_params = 0
        self.param = weakref.ref(param)
        self._params: list = [None] * n_params

    def __getitem__(self, index):
        return self._params[index]

    def __setitem__(self, index, value) -> None:
        if self._params[index] is not None:
            raise ValueError("Cannot set a parameter twice.")
        self._params[index] = value
        self.set_params += 1
        if self.set_params == self.n_params:
            self.param().complete_component()

    def __iter__(self):
        return iter(self._params)


def ParamList(attr: str) -> type:  # noqa: N802 - DeepSpeed's name
    """A ``ParametrizedList`` subclass whose length is the inference model's ``attr``."""
    return type("ParametrizedListInstance", (ParametrizedList, ), {"count_attr": attr})


def _is_dependency(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, (torch.Tensor, ParametrizedList))


class ParameterMetaclass(type):
    """Turns each dependency annotation into a property: setting a tensor dependency counts it as complete; a
    parameter list is read-only (its items are set)."""

    def __new__(mcs, clsname, bases, attrs):
        annotations = annotations_of_namespace(attrs)
        dependencies = {name: kind for name, kind in annotations.items() if _is_dependency(kind)}
        for name, kind in dependencies.items():
            attrs[name] = property(_getter(clsname, name),
                                   _readonly_setter if issubclass(kind, ParametrizedList) else _setter(clsname, name))
        cls = super().__new__(mcs, clsname, bases, attrs)
        cls._ds_dependencies = dependencies
        cls.n_dependencies = len(dependencies)
        return cls

    def __call__(cls, *args, **kwargs):
        obj = super().__call__(*args, **kwargs)
        obj.dest_param = None
        for name, kind in cls._ds_dependencies.items():
            if issubclass(kind, ParametrizedList):
                if not hasattr(obj.inference_model, kind.count_attr):
                    raise ValueError(f"{cls.__name__}.{name}: the inference model has no attribute "
                                     f"{kind.count_attr!r} (the length of this parameter list)")
                value = kind(obj, getattr(obj.inference_model, kind.count_attr))
            else:
                value = None
            setattr(obj, f"__{cls.__name__}__{name}", value)
        return obj


def _getter(clsname: str, name: str):
    return lambda self: getattr(self, f"__{clsname}__{name}")


def _setter(clsname: str, name: str):
    def set_dependency(self, value: torch.Tensor) -> None:
        setattr(self, f"__{clsname}__{name}", value)
        self.dtype = value.dtype
        self.complete_component()
    return set_dependency


def _readonly_setter(self, value) -> None:
    raise ValueError("Cannot set a ParametrizedList directly.")


class ParameterBase(metaclass=ParameterMetaclass):
    """Subclass with dependency annotations and a ``finalize()`` returning the finished tensor (usually through a
    ``transform_*_param`` of the inference model, which shards and converts it)."""

    def __init__(self, model: object, parent_container: object) -> None:
        self.inference_model = model
        self.completed_components = 0
        self.parent_container = weakref.ref(parent_container)

    @abstractmethod
    def finalize(self) -> torch.Tensor:
        ...

    def complete_component(self) -> None:
        """One more dependency is set; with all of them, finalize and hand the result to the container."""
        self.completed_components += 1
        if self.completed_components != self.n_dependencies:
            return
        self.parent_container().finalization_callback(self, self.finalize())


__all__ = ["MAPPING_KEY", "ParamList", "ParameterBase", "ParameterMetaclass", "ParametrizedList"]
