"""Turning pydantic's validation errors into dsrun :class:`~dsrun.utils.errors.Problem` lines.

Each problem names the dotted key path (``zero_optimization.offload_optimizer.device``; list items as
``[i]``), the bad value, what is allowed, and for an unknown key the closest known key.
"""
from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from dsrun.utils.errors import Problem, show
from dsrun.utils.suggest import did_you_mean

from .base import RawValue
from .schema_keys import Annotation, section_model

_MISSING = object()


def join_path(prefix: str, parts: list[str | int]) -> str:
    """``prefix`` + parts as ``a.b[0].c``."""
    text = prefix
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text = f"{text}.{part}" if text else str(part)
    return text


def _data_path(data: RawValue, loc: tuple, error_type: str) -> tuple[list[str | int], RawValue]:
    """The parts of pydantic's ``loc`` that index the user's data (dropping union tags), and the value."""
    parts: list[str | int] = []
    current = data
    for index, part in enumerate(loc):
        last = index == len(loc) - 1
        if isinstance(current, dict) and isinstance(part, str) and part in current:
            parts.append(part)
            current = current[part]
        elif isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current):
            parts.append(part)
            current = current[part]
        elif last and error_type == "missing" and isinstance(part, str):
            parts.append(part)
            current = _MISSING
        # anything else is a pydantic union/function tag such as 'int' or 'function-after[...]'
    return parts, current


def _child(annotation: Annotation, part: str | int) -> Annotation | None:
    """The annotation of ``part`` inside ``annotation`` (a model, dict[str, X], list[X] or a union of them)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if isinstance(part, str) and part in annotation.model_fields:
            return annotation.model_fields[part].annotation
        return None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is dict and len(args) == 2 and isinstance(part, str):
        return args[1]
    if origin is list and args and isinstance(part, int):
        return args[0]
    for arg in args:  # Optional / Union / Annotated
        found = _child(arg, part)
        if found is not None:
            return found
    return None


def _model_at(model: type[BaseModel], parts: list[str | int]) -> type[BaseModel] | None:
    """The section model that holds the last key of ``parts`` (for "did you mean" suggestions)."""
    current: Any = model
    for part in parts[:-1]:
        current = _child(current, part)
        if current is None:
            return None
    return section_model(current)


# Plain words for pydantic's type errors.
_TYPE_WORDS = {
    "bool_parsing": "true or false", "bool_type": "true or false",
    "int_parsing": "an integer", "int_type": "an integer", "int_from_float": "a whole number",
    "float_parsing": "a number", "float_type": "a number", "string_type": "a string",
    "list_type": "a list", "tuple_type": "a list", "dict_type": "an object (a dict of keys)",
}


def _allowed_text(msg: str) -> str:
    # pydantic says "Input should be ..."; rephrase as what is allowed.
    if msg.startswith("Input should be "):
        return "allowed: " + msg[len("Input should be "):]
    return msg[:1].lower() + msg[1:]


def problems_from_validation_error(
    err: ValidationError, data: RawValue, model: type[BaseModel], prefix: str = ""
) -> list[Problem]:
    """One Problem per pydantic error, keyed by the dotted path under ``prefix``."""
    problems: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for error in err.errors(include_url=False):
        error_type = error["type"]
        parts, value = _data_path(data, tuple(error["loc"]), error_type)
        path = join_path(prefix, parts)
        hint = ""
        if error_type == "extra_forbidden":
            key = str(parts[-1]) if parts else ""
            owner = _model_at(model, parts)
            choices = list(owner.model_fields) if owner else []
            message = f"unknown key {key!r} (value {show(value)})"
            hint = did_you_mean(key, choices)
            if not hint and choices:
                hint = "allowed keys: " + ", ".join(choices[:25]) + (", ..." if len(choices) > 25 else "")
        elif error_type == "missing":
            message = "required key is missing"
        elif error_type in ("model_type", "model_attributes_type", "dict_type"):
            message = f"got {show(value)}; must be an object (a dict of keys)"
        elif error_type in _TYPE_WORDS:
            message = f"got {show(value)}; allowed: {_TYPE_WORDS[error_type]}"
        else:
            message = f"got {show(value)}; {_allowed_text(error['msg'])}"
            if error_type == "literal_error" and isinstance(value, str):
                expected = error.get("ctx", {}).get("expected", "")
                choices = [c.strip().strip("'") for c in expected.replace(" or ", ",").split(",") if c.strip()]
                hint = did_you_mean(value, choices)
        marker = (path, message)
        if marker in seen:
            continue
        seen.add(marker)
        problems.append(Problem(path, message, hint))
    return _merge_alternatives(problems)


def _merge_alternatives(problems: list[Problem]) -> list[Problem]:
    """One line per key: a value failing every branch of a union ("an int >= 1, or 'auto'") is reported
    once, with the alternatives joined."""
    merged: dict[str, Problem] = {}
    for problem in problems:
        first = merged.get(problem.path)
        if first is None:
            merged[problem.path] = problem
            continue
        extra = problem.message.split("; ", 1)[-1].replace("allowed: ", "")
        merged[problem.path] = Problem(first.path, f"{first.message}, or {extra}", first.hint or problem.hint)
    return list(merged.values())


def split_unknown_top_level(model: type[BaseModel], data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` without its unknown top-level keys that resemble no known key, and those keys.

    DeepSpeed ignores unknown top-level keys (``cuda_visible_devices``, a launcher's own notes); so does
    dsrun, with one warning line. A near miss (``zero_optimisation``) stays in, to be refused with a
    "did you mean"."""
    known = list(model.model_fields)
    dropped = [key for key in data if key not in known and not did_you_mean(str(key), known)]
    return {k: v for k, v in data.items() if k not in dropped}, dropped


def validate_model(model: type[BaseModel], data: RawValue, prefix: str) -> tuple[BaseModel | None, list[Problem]]:
    """Validate ``data`` against ``model``; the instance or None, and the problems under ``prefix``."""
    try:
        return model.model_validate(data), []
    except ValidationError as err:
        return None, problems_from_validation_error(err, data, model, prefix)
