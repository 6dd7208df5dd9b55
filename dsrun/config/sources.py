"""Reading a DeepSpeed config from any of the forms DeepSpeed accepts, plus YAML.

Forms: a dict; a path (``.json`` and ``.hjson`` files are read with hjson, as DeepSpeed does, so comments
and relaxed syntax work; ``.yaml``/``.yml`` with PyYAML); JSON or hjson text; a base64-encoded JSON string
(what ``deepspeed --deepspeed_config`` receives from some launchers). Duplicate keys are an error in every
form, as in DeepSpeed, because the later value silently wins otherwise.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson
import yaml

from dsrun.utils.errors import ConfigError, Problem, show

from .base import RawValue

ConfigSource = Mapping[str, Any] | str | os.PathLike


class DuplicateKeyError(ValueError):
    def __init__(self, keys: list[str]):
        self.keys = keys
        super().__init__(", ".join(keys))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    duplicates: list[str] = []
    for key, value in pairs:
        if key in seen:
            duplicates.append(key)
        seen[key] = value
    if duplicates:
        raise DuplicateKeyError(duplicates)
    return seen


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping with the same key twice."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    pairs = [(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep)) for k, v in node.value]
    return _no_duplicates(pairs)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _plain(value: RawValue) -> RawValue:
    """Copy nested mappings into plain dicts (hjson returns OrderedDicts, OmegaConf returns DictConfigs)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _parse_json_text(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except DuplicateKeyError as err:
        raise _duplicate_error(where, err.keys) from None
    except json.JSONDecodeError:
        # DeepSpeed parses config files with hjson: comments, unquoted keys and trailing commas are accepted.
        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except DuplicateKeyError as err:
            raise _duplicate_error(where, err.keys) from None
        except hjson.HjsonDecodeError as err:
            raise ConfigError(Problem(where, f"not valid JSON or hjson: {err}")) from None
    return _as_mapping(data, where)


def _parse_yaml_text(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except DuplicateKeyError as err:
        raise _duplicate_error(where, err.keys) from None
    except yaml.YAMLError as err:
        raise ConfigError(Problem(where, f"not valid YAML: {err}".replace("\n", " "))) from None
    return _as_mapping(data, where)


def _duplicate_error(where: str, keys: list[str]) -> ConfigError:
    return ConfigError(
        Problem(where, f"duplicate keys in DeepSpeed config: {', '.join(repr(k) for k in keys)}",
                "each key may appear once per object; the later value would silently win")
    )


def _as_mapping(data: RawValue, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(Problem(where, f"a DeepSpeed config must be a JSON object, got {type(data).__name__}"))
    return _plain(data)


def _looks_like_path(text: str) -> bool:
    stripped = text.strip()
    if not stripped or stripped[0] in "{[" or "\n" in stripped:
        return False
    return stripped.endswith((".json", ".hjson", ".yaml", ".yml")) or os.sep in stripped


def _try_base64(text: str) -> str | None:
    compact = "".join(text.split())
    if not compact or len(compact) % 4 or compact.startswith("{"):
        return None
    try:
        decoded = base64.b64decode(compact, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def read_config_source(source: ConfigSource) -> dict[str, Any]:
    """Read a DeepSpeed config into a plain dict, without validating it.

    ``source`` is a mapping, a path to a ``.json``/``.hjson``/``.yaml``/``.yml`` file, JSON (or hjson) text,
    or base64-encoded JSON. Raises :class:`~dsrun.utils.errors.ConfigError` naming the file when it is
    missing, unreadable, malformed, not an object, or has a duplicate key.
    """
    if isinstance(source, Mapping):
        if hasattr(source, "_content") and hasattr(source, "_metadata"):  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            return _as_mapping(OmegaConf.to_container(source, resolve=True), "config")
        return _as_mapping(source, "config")
    if isinstance(source, os.PathLike):
        return _read_file(Path(source))
    if not isinstance(source, str):
        raise ConfigError(Problem("config", f"expected a dict, a file path, JSON text or base64 JSON, "
                                            f"got {type(source).__name__}"))
    if _looks_like_path(source):
        return _read_file(Path(source).expanduser())
    stripped = source.strip()
    if stripped.startswith("{"):
        return _parse_json_text(stripped, "config")
    decoded = _try_base64(stripped)
    if decoded is not None:
        return _parse_json_text(decoded, "config (base64)")
    if Path(stripped).expanduser().exists():
        return _read_file(Path(stripped).expanduser())
    raise ConfigError(Problem(f"config {show(stripped)}", "is neither an existing file, JSON text, "
                              "nor base64-encoded JSON", "give a path to a .json/.hjson/.yaml file"))


def _read_file(path: Path) -> dict[str, Any]:
    where = str(path)
    if not path.is_file():
        hint = "the path is a directory" if path.is_dir() else "check the path"
        raise ConfigError(Problem(where, "config file not found", hint))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(Problem(where, f"cannot read config file: {err}")) from None
    if path.suffix.lower() in (".yaml", ".yml"):
        return _parse_yaml_text(text, where)
    return _parse_json_text(text, where)
