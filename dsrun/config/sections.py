"""One section of a DeepSpeed config, typed, from whatever form the config has at hand.

Code outside :mod:`dsrun.config` that needs a setting before (or without) the engine reads it here, never from
the raw dict with a default of its own: the schema's section models hold every default.

* :class:`ResolvedDsConfig` is a resolved config dict (what ``dsrun train``'s launcher writes to the run
  directory) that carries the typed config this process built from it once (:func:`dsrun.config.load_resolved`),
  so ``dsrun.initialize`` and ``dsrun.zero.Init`` take it instead of parsing the dict again.
* :func:`ds_section` returns one typed section of a typed config, a :class:`ResolvedDsConfig`, or a raw dict
  (legacy keys migrated, ``"auto"`` dropped, that section validated alone).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Annotated, Any, Mapping

from pydantic import BaseModel

from dsrun.utils.errors import ConfigError

from .auto import resolve_auto
from .migrate import migrate_legacy
from .model import DSConfig
from .problems import validate_model

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo


class ResolvedDsConfig(dict):
    """A resolved DeepSpeed config dict with ``typed``, the :class:`DSConfig` built from it for a
    data-parallel size of ``world_size``. It reads as the plain dict everywhere; a copy is a plain dict (an
    edited copy is parsed again where it is used). Do not edit it in place: ``typed`` would not follow."""

    def __init__(self, data: Mapping[str, Any], typed: DSConfig, world_size: int | None):
        super().__init__(data)
        self.typed, self.world_size = typed, world_size

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return copy.deepcopy(dict(self), memo)

    def __reduce__(self) -> Any:  # pickles as the plain dict it reads as
        return dict, (dict(self),)

    def with_sections(self, data: Mapping[str, Any]) -> "ResolvedDsConfig":
        """``data`` (this config with some top-level sections changed, e.g. paths filled in) marked resolved
        too: only the sections that differ are validated, the rest of ``typed`` is kept."""
        changed = {key for key in set(self) | set(data) if self.get(key) != data.get(key)}
        update = {key: ds_section(data, key) for key in changed if key in DSConfig.model_fields}
        return ResolvedDsConfig(data, self.typed.model_copy(update=update), self.world_size)


def typed_config(config: object) -> DSConfig | None:
    """The typed config ``config`` (anything a caller holds) is or carries; None for a raw dict, a path or JSON text."""
    if isinstance(config, DSConfig):
        return config
    return config.typed if isinstance(config, ResolvedDsConfig) else None


def ds_section(config: DSConfig | Mapping[str, Any] | None, name: str) -> Any:
    """The typed top-level setting ``name`` (a section such as ``"zero_optimization"``, or a value such as
    ``"gradient_clipping"``) of ``config``: a typed :class:`DSConfig`, a :class:`ResolvedDsConfig`, a
    raw dict or None (the schema's default). A raw dict's legacy keys are migrated and its ``"auto"`` values
    dropped, as a whole-config parse does, then the one setting is validated (a ConfigError lists its
    problems); the batch sizes are the values given, not resolved (None when not given)."""
    typed = typed_config(config)
    if typed is not None:
        return getattr(typed, name)
    data, problems, _ = migrate_legacy(dict(config or {}), quiet=True)  # the whole config's parse warns
    data, _, _ = resolve_auto(data, None)
    field = DSConfig.model_fields[name]
    value = data.get(name)
    if value is None:
        return field.get_default(call_default_factory=True)
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        model, section_problems = validate_model(annotation, value, name)
    else:
        model, section_problems = _validate_value(field, value, name)
    problems = [p for p in problems + section_problems if p.path.split(".")[0].split("[")[0] == name]
    if problems:
        raise ConfigError(problems)
    return model


def _validate_value(field: FieldInfo, value: object, name: str) -> tuple[Any, list[Any]]:
    from pydantic import TypeAdapter, ValidationError

    from dsrun.utils.errors import Problem

    try:
        kind = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        return TypeAdapter(kind).validate_python(value), []
    except ValidationError as err:
        return None, [Problem(name, f"got {value!r}: {err.errors()[0]['msg']}")]
