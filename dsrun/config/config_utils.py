"""``deepspeed.runtime.config_utils``: the base DeepSpeed's own config models (and client code's) derive from,
and its raw getters.

dsrun's sections derive from :class:`dsrun.config.base.Section`; :class:`DeepSpeedConfigModel` is for code
written against DeepSpeed: a pydantic model that forbids unknown keys, validates on assignment, drops values
written as ``"auto"`` (Hugging Face fills those in later) and honours DeepSpeed's deprecated fields. A field
declared ``Field(..., json_schema_extra={"deprecated": True, "new_param": "new", "new_param_fn": fn})`` is
still accepted, logs a warning when set, and moves its value (through ``fn``) to ``new`` (a dotted path
reaches into a nested model); giving both the old and the new key is an AssertionError, as in DeepSpeed.
"""
from __future__ import annotations

import collections
import functools
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from dsrun.utils.logging import logger


class DeepSpeedConfigModel(BaseModel):
    """DeepSpeed's config base model (see the module docstring); ``strict=True`` keeps ``"auto"`` values."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:  # "auto" is for Hugging Face to fill in; replace_method's "auto" is a real value
            data = {k: v for k, v in data.items() if v != "auto" or k == "replace_method"}
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._move_deprecated(name, extra)

    def _move_deprecated(self, old: str, extra: dict[str, Any]) -> None:
        if old not in self.model_fields_set:
            return
        new = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        logger.warning(f"Config parameter {old} is deprecated" + (f" use {new} instead" if new else "")
                       + (f". {note}" if note else ""))
        if not new or not extra.get("set_new_param", True):
            return
        convert: Callable[[Any], Any] = extra.get("new_param_fn", lambda value: value)
        value = convert(getattr(self, old))
        delattr(self, old)
        *parents, name = new.split(".")
        owner = functools.reduce(getattr, parents, self)
        assert name not in owner.model_fields_set, \
            f"Cannot provide deprecated parameter '{old}' and replacing parameter '{new}' together"
        setattr(owner, name, value)


def get_config_default(config: type[BaseModel], field_name: str) -> Any:
    """A field's default (AssertionError for an unknown or a required field, as DeepSpeed)."""
    field = config.model_fields.get(field_name)
    assert field is not None, f"'{field_name}' is not a field in {config}"
    assert not field.is_required(), f"'{field_name}' is a required field and does not have a default value"
    return field.get_default()


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]`` as written, or the default (DeepSpeed's raw getters: no validation)."""
    return param_dict.get(param_name, param_default_value)


get_list_param = get_dict_param = get_scalar_param


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.load``'s ``object_pairs_hook`` that refuses a key written twice (ValueError naming it)."""
    counts = collections.Counter(key for key, _ in ordered_pairs)
    repeated = [key for key, n in counts.items() if n > 1]
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return dict(ordered_pairs)
