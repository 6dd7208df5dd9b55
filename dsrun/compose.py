"""Hydra composition: ``conf/`` + ``recipes/`` + command-line overrides → the RunSpec.

The RunSpec has five top-level keys: ``model``, ``data``, ``train``, ``launcher`` and ``ds`` (the DeepSpeed
config), plus ``ds_config`` (an optional DeepSpeed file merged into ``ds``). Config groups write into those
keys; a recipe is a ``# @package _global_`` file selected with ``+recipe=NAME`` that overrides groups and
values. Recipes live in ``recipes/`` (and in any ``--recipes-dir``), which Hydra sees as the group ``recipe``.

Two conveniences on top of plain Hydra, both documented in the README:

* a DeepSpeed key may be written without its ``ds.`` prefix (``optimizer.params.lr=3e-4``,
  ``gradient_clipping=0.5``) when it is not also a RunSpec key or a group name;
* with no recipe given, ``+recipe=default`` is used.

``source`` (``dsrun train --from RUN_DIR``) composes from a run directory's own record of its composition,
``RUN_DIR/.hydra/config.yaml``, instead of ``conf/`` and a recipe; overrides then set its keys.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from omegaconf import DictConfig, OmegaConf

from dsrun.utils.errors import Problem, UserError, show
from dsrun.utils.paths import conf_dir, recipes_dir
from dsrun.utils.suggest import did_you_mean

PRIMARY_CONFIG = "dsrun"
RUNSPEC_KEYS = ("model", "data", "train", "launcher", "ds")
DEFAULT_RECIPE = "default"
RECIPES_ENV = "DSRUN_RECIPES_PATH"  # extra recipe folders, separated by os.pathsep
# ds sections a ds_config file replaces whole instead of merging key by key: their params are one
# constructor's arguments (SGD's momentum must not reach AdamW)
REPLACED_BY_FILE = ("optimizer", "scheduler")


# ---------------------------------------------------------------------------------------------- recipes
def recipe_dirs(extra: Iterable[str | Path] = ()) -> list[Path]:
    """Recipe folders in lookup order: the built-in one, then $DSRUN_RECIPES_PATH, then ``extra``.

    A later folder's recipe of the same name wins.
    """
    dirs = [recipes_dir()]
    dirs += [Path(p) for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep) if p]
    dirs += [Path(p) for p in extra]
    problems = [Problem(str(d), "recipe folder not found", "pass an existing directory to --recipes-dir")
                for d in dirs if not d.is_dir()]
    if problems:
        raise UserError(problems)
    return [d.resolve() for d in dirs]


def list_recipes(extra_dirs: Iterable[str | Path] = ()) -> dict[str, tuple[Path, str]]:
    """Every recipe name → (file, its description: the first sentence of the comment at its top)."""
    found: dict[str, tuple[Path, str]] = {}
    for folder in recipe_dirs(extra_dirs):
        for path in sorted(folder.glob("*.yaml")):
            found[path.stem] = (path, recipe_description(path))
    return dict(sorted(found.items()))


_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)(?<!\betc)[.!?](?=\s|$)")


def recipe_description(path: Path) -> str:
    """The first sentence of the comment block at the top of a recipe (below ``# @package``), however many
    comment lines it takes; the whole block when it has no sentence end."""
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#"):
            if lines or line.strip():
                break
            continue
        if text.startswith("@package"):
            continue
        if not text:
            if lines:
                break
            continue
        lines.append(text)
    block = " ".join(lines)
    end = _SENTENCE_END.search(block)
    return block[:end.end()] if end else block


def _group_root_for(folder: Path) -> Path:
    """A cached folder whose ``recipe`` entry links to ``folder``, so Hydra sees the group ``recipe``."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsrun" / "searchpath"
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        base = Path(tempfile.gettempdir()) / f"dsrun-searchpath-{os.getuid()}"
        base.mkdir(parents=True, exist_ok=True)
    root = base / hashlib.sha1(str(folder).encode()).hexdigest()[:16]
    root.mkdir(exist_ok=True)
    link = root / "recipe"
    if not (link.is_symlink() and Path(os.readlink(link)) == folder):
        tmp = root / f".recipe.{os.getpid()}"
        if tmp.is_symlink():
            tmp.unlink()
        os.symlink(folder, tmp)
        os.replace(tmp, link)  # atomic, so concurrent multirun jobs never see a half-made link
    return root


def searchpath_override(extra_dirs: Iterable[str | Path] = (), user_entries: Sequence[str] = ()) -> str:
    # Hydra takes a config from the first search-path entry that has it, so user folders go first and
    # the built-in recipes last: a user's recipe shadows a built-in one of the same name.
    roots = [f"file://{_group_root_for(d)}" for d in reversed(recipe_dirs(extra_dirs))]
    return "hydra.searchpath=[" + ",".join([*user_entries, *roots]) + "]"


# -------------------------------------------------------------------------------------------- overrides
def config_groups() -> list[str]:
    return sorted(p.name for p in conf_dir().iterdir() if p.is_dir()) + ["recipe"]


def _ds_top_level_keys() -> set[str]:
    from dsrun.config import DSConfig

    return set(_schema_fields(DSConfig))


def config_location(source: Path | None = None) -> tuple[Path, str]:
    """(config folder, config name) composition starts from: ``conf/dsrun.yaml``, or a run directory's
    ``.hydra/config.yaml``."""
    return (Path(source) / ".hydra", "config") if source is not None else (conf_dir(), PRIMARY_CONFIG)


def _schema_fields(model: type) -> dict[str, object]:
    fields = dict(model.model_fields)
    fields.update({f.alias: f for f in model.model_fields.values() if f.alias})
    return fields


def ds_schema_keys(path: str) -> list[str] | None:
    """The keys the DeepSpeed schema documents at ``path`` (``"tensorboard"``; ``""`` for the top level), or
    None when ``path`` is not a section of the schema (an open dict such as ``optimizer.params``, a value)."""
    from dsrun.config import DSConfig
    from dsrun.config.problems import section_model

    model: type | None = DSConfig
    for part in [p for p in path.split(".") if p]:
        field = _schema_fields(model).get(part)
        model = section_model(field.annotation) if field is not None else None
        if model is None:
            return None
    return sorted(_schema_fields(model))


def is_documented_ds_key(key: str) -> bool:
    """True when ``key`` (``ds.tensorboard.output_path``) is a key of the DeepSpeed schema itself."""
    if not key.startswith("ds."):
        return False
    parent, _, leaf = key[3:].rpartition(".")
    return leaf in (ds_schema_keys(parent) or ())


def normalize_overrides(overrides: Sequence[str], default_recipe: bool = True) -> tuple[list[str], list[str]]:
    """Apply the two conveniences (the default recipe only with ``default_recipe``); split out the user's own
    ``hydra.searchpath`` entries.

    Returns (overrides for Hydra, extra search-path entries).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    groups, ds_keys = set(config_groups()), _ds_top_level_keys()
    result, user_searchpath, has_recipe = [], [], False
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception as err:  # OverrideParseException and friends
            raise UserError(Problem(text, f"cannot parse this override: {_first_line(err)}",
                                    "overrides look like key=value, +key=value, ~key or group=option")) from None
        key = override.key_or_group
        head = key.split(".")[0]
        if key == "hydra.searchpath":
            user_searchpath += [str(v) for v in override.value()]
            continue
        if head == "recipe":
            has_recipe = True
        elif head in ds_keys and head not in RUNSPEC_KEYS and ("." in key or head not in groups):
            # `optimizer=adam` picks a group option; `optimizer.params.lr=1e-4` sets a DeepSpeed key
            prefix = text[: len(text) - len(text.lstrip("+~"))]
            text = f"{prefix}ds.{text[len(prefix):]}"
        if text[:1] not in "+~" and is_documented_ds_key(text.split("=", 1)[0]):
            text = f"++{text}"  # a documented DeepSpeed key the recipe does not set: add it, as a ds_config would
        result.append(text)
    if not has_recipe and default_recipe:
        result.insert(0, f"+recipe={DEFAULT_RECIPE}")
    return result, user_searchpath


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


# ------------------------------------------------------------------------------------------ composition
def compose_runspec(overrides: Sequence[str] = (), recipes_dirs: Iterable[str | Path] = (),
                    *, resolve: bool = True, source: Path | None = None) -> DictConfig:
    """Compose the RunSpec from the built-in config, a recipe and ``overrides`` (Hydra syntax).

    ``ds_config=FILE`` merges a DeepSpeed file into ``ds``; ``ds.*`` overrides still win over it. Raises
    :class:`UserError` naming the bad override, recipe or key. The result is resolved (no interpolations
    left) unless ``resolve=False``; it is not validated (see :mod:`dsrun.runspec`).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    recipes_dirs = list(recipes_dirs)
    hydra_overrides = app_overrides(overrides, recipes_dirs, source=source)
    config_dir, config_name = config_location(source)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name="dsrun"):
            cfg = compose(config_name=config_name, overrides=hydra_overrides)
    except Exception as err:
        raise composition_error(err, hydra_overrides, recipes_dirs, source=source) from None
    finally:
        GlobalHydra.instance().clear()
    return finish_runspec(cfg, hydra_overrides, resolve=resolve)


def _composed_keys(parent: str, hydra_overrides: Sequence[str], source: Path | None) -> list[str]:
    """The keys at ``parent`` in the config the overrides compose to (no interpolation resolved); [] when
    they do not compose or ``parent`` is no mapping there."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir, config_name = config_location(source)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name="dsrun"):
            node = OmegaConf.select(compose(config_name=config_name, overrides=list(hydra_overrides)), parent)
    except Exception:  # noqa: BLE001 - only a hint is at stake
        return []
    finally:
        GlobalHydra.instance().clear()
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def finish_runspec(cfg: DictConfig, hydra_overrides: Sequence[str], *, resolve: bool = True) -> DictConfig:
    """Merge ``ds_config`` into ``ds`` (then re-apply the command line's ``ds.*`` overrides) and resolve.
    The file's ``optimizer`` and ``scheduler`` sections replace the recipe's whole, as one choice."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    ordered = {key: plain[key] for key in (*RUNSPEC_KEYS, "ds_config") if key in plain}
    ordered.update((key, value) for key, value in plain.items() if key not in ordered)
    cfg = OmegaConf.create(ordered)  # a plain, writable copy in the RunSpec's reading order
    if cfg.get("ds_config"):
        from dsrun.config import read_config_source

        path = Path(str(cfg.ds_config)).expanduser()
        if not path.is_file():
            raise UserError(Problem("ds_config", f"file not found: {show(str(path))}",
                                    "give the path of a DeepSpeed JSON/hjson/YAML config"))
        from_file = read_config_source(path)
        for key in REPLACED_BY_FILE:  # a file's optimizer is a whole: its params must not mix with the group's
            if key in from_file and key in cfg.ds:
                del cfg.ds[key]
        cfg.ds = OmegaConf.merge(cfg.ds, from_file)
        _reapply_ds_overrides(cfg, hydra_overrides)
    if resolve:
        try:
            OmegaConf.resolve(cfg)
        except Exception as err:
            raise UserError(Problem("", f"cannot resolve an interpolation: {_first_line(err)}",
                                    "check the ${...} references in your recipe")) from None
    return cfg


def _reapply_ds_overrides(cfg: DictConfig, hydra_overrides: Sequence[str]) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    for override in OverridesParser.create().parse_overrides(list(hydra_overrides)):
        key = override.key_or_group
        if not key.startswith("ds."):
            continue
        if override.type == OverrideType.DEL:
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key)
            if isinstance(parent, DictConfig) and leaf in parent:
                del parent[leaf]
        else:
            OmegaConf.update(cfg, key, override.value(), merge=False, force_add=True)


def composition_error(err: Exception, overrides: Sequence[str], recipes_dirs: Sequence[str | Path],
                      *, source: Path | None = None) -> UserError:
    """Turn one of Hydra's composition errors into a one-line :class:`UserError`."""
    import yaml
    from hydra.errors import MissingConfigException

    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}"
        return UserError(Problem(where, f"malformed YAML: {err.problem}"
                                 + (f" ({err.context})" if err.context else ""), "fix the file's syntax"))
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = str(err.missing_cfg_file).rpartition("/")
        if group == "recipe":
            names = list(list_recipes(recipes_dirs))
            return UserError(Problem(f"+recipe={option}", f"unknown recipe '{option}'; available: "
                                     + ", ".join(names), did_you_mean(option, names)
                                     or "add --recipes-dir DIR for your own recipes"))
        options = list(err.options or [])
        if group and options:
            return UserError(Problem(f"{group}={option}", f"unknown option '{option}' for config group "
                                     f"'{group}'; available: {', '.join(options)}", did_you_mean(option, options)))
    message = _first_line(err)
    for text in overrides:  # name the override Hydra complains about, when it quotes one
        key = text.lstrip("+~").split("=")[0]
        if f"'{key}'" in str(err):
            if "not in struct" in str(err) or "Could not override" in str(err):
                parent = key.rpartition(".")[0]
                siblings = _composed_keys(parent, [o for o in overrides if o != text], source) if parent else []
                return UserError(Problem(key, "no such key in the composed config",
                                         _struct_hint(key, text, siblings)))
            return UserError(Problem(text, message))
    return UserError(Problem("", message, "run with --debug for Hydra's full report"))


def _struct_hint(key: str, text: str, siblings: Sequence[str]) -> str:
    """"did you mean" a key the composed config has beside it, or (under ``ds``) one the DeepSpeed schema
    documents there; with no close match, how to add a new key."""
    head, _, leaf = key.rpartition(".")
    candidates = set(siblings)
    if key.startswith("ds."):
        candidates |= set(ds_schema_keys(head[3:]) or ())
    return did_you_mean(leaf, candidates) or f"to add a new key write +{text.lstrip('+')}"


def runspec_to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, sort_keys=False)


def run_app(task_function, overrides: Sequence[str] = (), recipes_dirs: Iterable[str | Path] = (),
            *, multirun: bool = False, source: Path | None = None):
    """Run ``task_function(cfg)`` as a Hydra application: a run directory per job (``outputs/DATE/TIME`` or
    ``multirun/DATE/TIME/N``), Hydra's logging, and sweeps with ``multirun=True``.

    ``cfg`` reaches the task composed but not yet merged with ``ds_config``: call :func:`finish_runspec`
    with the overrides it returns from :func:`app_overrides`.
    """
    import sys

    import hydra

    from hydra_plugins.dsrun_optuna_sweeper import register_with_hydra

    register_with_hydra()  # hydra/sweeper=optuna, whatever kind of install dsrun has
    hydra_overrides = app_overrides(overrides, recipes_dirs, source=source)
    config_dir, config_name = config_location(source)
    argv = sys.argv
    sys.argv = ["dsrun", *hydra_overrides, "hydra.job.name=dsrun", *(["--multirun"] if multirun else [])]
    try:
        main = hydra.main(version_base="1.3", config_path=str(config_dir), config_name=config_name)
        return main(task_function)()
    finally:
        sys.argv = argv


def app_overrides(overrides: Sequence[str], recipes_dirs: Iterable[str | Path] = (),
                  *, source: Path | None = None) -> list[str]:
    """The overrides as Hydra receives them: conveniences applied, recipe folders on the search path."""
    hydra_overrides, user_searchpath = normalize_overrides(overrides, default_recipe=source is None)
    hydra_overrides.append(searchpath_override(recipes_dirs, user_searchpath))
    return hydra_overrides
