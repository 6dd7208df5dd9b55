"""Every key the DeepSpeed config schema accepts, as dotted patterns, with its type and default.

A pattern names a leaf of the schema: ``zero_optimization.offload_param.device``. Where the schema has an open
mapping of sections (compression groups, curriculum metrics), the user's own name is written ``*``:
``compression_training.weight_quantization.different_groups.*.params.start_bits``. Open dicts of free keys
(``optimizer.params``, ``compile.kwargs``) are leaves themselves.

:func:`schema_keys` is what the support ledger (:mod:`.support`) must cover, key for key;
:func:`match_pattern` turns a concrete key path (``...different_groups.wq1.params.start_bits``) into its
pattern; :func:`type_text` renders a field's type for ``dsrun config --explain``.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

WILDCARD = "*"
# A field's type as pydantic stores it: a class, ``X | None``, ``dict[str, X]``, ``Annotated[X, ...]``; any
# object typing builds, so the readers below take every object and look inside with ``typing.get_origin``.
Annotation = object


@dataclass(frozen=True)
class SchemaKey:
    """One leaf of the schema: its pattern, the section model that owns it and the field."""

    pattern: str
    owner: type[BaseModel]
    name: str
    field: FieldInfo

    @property
    def default(self) -> Any:
        """The value the schema gives the key when the config does not set it."""
        if self.field.default_factory is not None:
            return self.field.default_factory()  # type: ignore[call-arg]
        return None if self.field.default is PydanticUndefined else self.field.default

    @property
    def type_text(self) -> str:
        return type_text(self.field.annotation, self.field.metadata)


def section_model(annotation: Annotation) -> type[BaseModel] | None:
    """The section model inside ``annotation`` (``X``, ``X | None``, ``Annotated[X, ...]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (dict, list):
        return None
    for arg in typing.get_args(annotation):
        found = section_model(arg)
        if found is not None:
            return found
    return None


def mapped_section_model(annotation: Annotation) -> type[BaseModel] | None:
    """The value model of a ``dict[str, Section]`` field (also inside ``| None``), if any."""
    if typing.get_origin(annotation) is dict:
        return section_model(typing.get_args(annotation)[1])
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is dict:
            return section_model(typing.get_args(arg)[1])
    return None


def _walk(model: type[BaseModel], prefix: str) -> list[SchemaKey]:
    keys: list[SchemaKey] = []
    for name, field in model.model_fields.items():
        pattern = f"{prefix}{name}"
        mapped = mapped_section_model(field.annotation)
        nested = section_model(field.annotation)
        if mapped is not None:
            keys += _walk(mapped, f"{pattern}.{WILDCARD}.")
        elif nested is not None:
            keys += _walk(nested, f"{pattern}.")
        else:
            keys.append(SchemaKey(pattern, model, name, field))
    return keys


@lru_cache(maxsize=None)
def _keys_of(root: type[BaseModel]) -> tuple[SchemaKey, ...]:
    return tuple(_walk(root, ""))


def schema_keys(root: type[BaseModel]) -> dict[str, SchemaKey]:
    """pattern -> :class:`SchemaKey`, for every leaf key of ``root`` (``DSConfig``: the whole schema;
    passed in, since the config model's modules import this one)."""
    return {key.pattern: key for key in _keys_of(root)}


def match_pattern(path: str, patterns: typing.Iterable[str]) -> str | None:
    """The pattern a concrete dotted ``path`` belongs to (``*`` matches one part), or None."""
    parts = path.split(".")
    for pattern in patterns:
        pparts = pattern.split(".")
        if len(pparts) == len(parts) and all(p == WILDCARD or p == q for p, q in zip(pparts, parts)):
            return pattern
    return None


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _bounds(metadata: typing.Iterable[Any]) -> list[str]:
    out = []
    for item in metadata:
        for attr, sign in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return out


def type_text(annotation: Annotation, metadata: typing.Iterable[Any] = ()) -> str:
    """A short reading of a field's type: ``int >= 0``, ``'none' | 'cpu' | 'nvme'``, ``bool``, ``dict``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        inner, *extra = args
        return type_text(inner, [*metadata, *extra])
    if origin is typing.Literal:
        text = " | ".join(repr(a) for a in args)
    elif origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        text = " | ".join(type_text(a) for a in args)
    elif origin in (list, tuple):
        text = f"list of {type_text(args[0])}" if args else "list"
    elif origin is dict:
        text = "dict"
    elif annotation is type(None):
        text = "null"
    elif isinstance(annotation, type):
        text = annotation.__name__
    else:
        text = str(annotation).replace("typing.", "")
    bounds = _bounds(metadata)
    return f"{text} {' '.join(bounds)}" if bounds else text
