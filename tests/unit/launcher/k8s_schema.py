"""Strict checks of a Kubernetes manifest against the API models the resources' own SDKs ship on PyPI.

The SDKs are generated from each resource's OpenAPI schema, and are what a Python client builds these objects
with: ``kubeflow-training`` (``kubeflow.org/v1`` PyTorchJob, over the ``kubernetes`` client's core models),
``kubeflow-trainer-api`` (``trainer.kubeflow.org/v1alpha1`` TrainJob and, for the JobSets its runtimes make,
``jobset.x-k8s.io/v1alpha2`` JobSet; JobSet has no SDK of its own on PyPI). Their deserialisers skip keys they do
not know (the API server's pruning would drop them too, silently), so each check walks the manifest against the
models' fields first: a key no model has is a problem, as is a value of the wrong shape. Then the models are
built from it, which checks required fields, types and enumerations.
"""
from __future__ import annotations

import typing
from typing import Any

import pydantic

# ---- pydantic models (kubeflow-trainer-api)


def _pydantic_fields(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    return {(info.alias or name): info.annotation for name, info in model.model_fields.items()}


def _pydantic_required(model: type[pydantic.BaseModel]) -> list[str]:
    # the schema's required fields (``from_dict`` fills some with their defaults, as a container's name with "")
    return [info.alias or name for name, info in model.model_fields.items() if info.is_required()]


def _pydantic_walk(annotation: Any, value: Any, path: str) -> list[str]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return _pydantic_walk(inner[0], value, path) if len(inner) == 1 else []
    if origin is list and isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _pydantic_walk(args[0], item, f"{path}[{i}]")]
    if origin is dict and isinstance(value, dict):
        return [p for key, item in value.items() for p in _pydantic_walk(args[1], item, f"{path}.{key}")]
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel) and isinstance(value, dict):
        fields = _pydantic_fields(annotation)
        problems = [f"{path or annotation.__name__}: {key} is required in {annotation.__name__}"
                    for key in _pydantic_required(annotation) if key not in value]
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key not in fields:
                problems.append(f"{where}: no such field in {annotation.__name__}")
            else:
                problems += _pydantic_walk(fields[key], item, where)
        return problems
    return []


def pydantic_problems(model: type[pydantic.BaseModel], manifest: dict) -> list[str]:
    """Why ``manifest`` is not a valid ``model`` (an SDK's pydantic model): unknown keys, then what building the
    model refuses."""
    problems = _pydantic_walk(model, manifest, "")
    try:
        model.from_dict(manifest)
    except (pydantic.ValidationError, ValueError, TypeError) as err:
        problems.append(f"{model.__name__}: {err}")
    return problems


# ---- OpenAPI-generator models (kubeflow-training over the kubernetes client)

_PRIMITIVES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float),
                                           "datetime": (str,), "date": (str,)}


def _openapi_class(name: str) -> type:
    import kubernetes.client.models as core
    from kubeflow.training import models as kubeflow

    for module in (kubeflow, core):
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(name)


def _openapi_build(type_name: str, value: Any, path: str, problems: list[str]) -> Any:
    """``value`` as the models build it, appending to ``problems`` what does not fit ``type_name``."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {value!r}")
            return None
        return [_openapi_build(type_name[5:-1], item, f"{path}[{i}]", problems) for i, item in enumerate(value)]
    if type_name.startswith("dict("):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {value!r}")
            return None
        inner = type_name[type_name.index(",") + 1:-1].strip()
        return {key: _openapi_build(inner, item, f"{path}.{key}", problems) for key, item in value.items()}
    if type_name == "object":
        return value
    if type_name in _PRIMITIVES:
        wrong_bool = isinstance(value, bool) and type_name != "bool"
        if not isinstance(value, _PRIMITIVES[type_name]) or wrong_bool:
            problems.append(f"{path}: expected {type_name}, got {value!r}")
        return value
    klass = _openapi_class(type_name)
    if not isinstance(value, dict):
        problems.append(f"{path}: expected a {type_name} mapping, got {value!r}")
        return None
    attributes = {key: attr for attr, key in klass.attribute_map.items()}
    kwargs = {}
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key not in attributes:
            problems.append(f"{where}: no such field in {type_name}")
            continue
        kwargs[attributes[key]] = _openapi_build(klass.openapi_types[attributes[key]], item, where, problems)
    try:
        return klass(**kwargs)
    except (ValueError, TypeError) as err:  # a required field missing, a value outside its enumeration
        problems.append(f"{path or type_name}: {err}")
        return None


def openapi_problems(type_name: str, manifest: dict) -> list[str]:
    """Why ``manifest`` is not a valid ``type_name`` (``KubeflowOrgV1PyTorchJob``, ``V1Job``...)."""
    problems: list[str] = []
    _openapi_build(type_name, manifest, "", problems)
    return problems


# ---- the three kinds dsrun export-job writes

def manifest_problems(manifest: dict) -> list[str]:
    """Why ``manifest`` (a PyTorchJob, TrainJob or JobSet, by its ``apiVersion`` and ``kind``) is not valid."""
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet, TrainerV1alpha1TrainJob

    kind = (manifest.get("apiVersion"), manifest.get("kind"))
    if kind == ("kubeflow.org/v1", "PyTorchJob"):
        return openapi_problems("KubeflowOrgV1PyTorchJob", manifest)
    if kind == ("trainer.kubeflow.org/v1alpha1", "TrainJob"):
        return pydantic_problems(TrainerV1alpha1TrainJob, manifest)
    if kind == ("jobset.x-k8s.io/v1alpha2", "JobSet"):  # each Job's template also as the kubernetes client has it
        jobs = manifest.get("spec", {}).get("replicatedJobs", [])
        return [*pydantic_problems(JobsetV1alpha2JobSet, manifest),
                *(p for i, job in enumerate(jobs) if isinstance(job, dict)
                  for p in openapi_problems("V1JobTemplateSpec", job.get("template", {})))]
    return [f"apiVersion/kind {kind} is none of PyTorchJob, TrainJob, JobSet"]
