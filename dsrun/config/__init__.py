"""The DeepSpeed config schema: load, validate and resolve a DeepSpeed JSON config.

::

    from dsrun.config import load_ds_config, validate_ds_config
    cfg = load_ds_config("ds_config.json", world_size=8, world_size_source="launcher plan")
    cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage, cfg.to_ds_dict()

Loading goes: read the source (:mod:`.sources`) -> migrate legacy keys (:mod:`.migrate`) -> resolve or drop
``"auto"`` values (:mod:`.auto`) -> validate every section (:mod:`.model`) -> resolve the batch triad
(:mod:`.batch`, :mod:`.elastic`) -> cross-field rules (:mod:`.rules`) -> the support ledger
(:mod:`.support`: a key dsrun does not implement is refused when the config enables it). Every problem found
on the way is collected, so one :class:`~dsrun.utils.errors.ConfigError` lists them all.

A process parses its config once: ``dsrun train``'s launcher resolves the RunSpec's ``ds``, each rank builds the
typed config from the resolved dict with :func:`load_resolved`, and what the rank hands on
(:class:`~.sections.ResolvedDsConfig`) carries it to ``dsrun.initialize`` and ``dsrun.zero.Init``.
:func:`parse_count` counts the parses of this process. Code that needs one setting reads its typed section
(:func:`~.sections.ds_section`), never the raw dict.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from dsrun.utils.errors import ConfigError, Problem

from dsrun.config.auto import resolve_auto
from dsrun.config.batch import GAS, MBS, TBS, BatchResolution, resolve_batch
from dsrun.config.elastic import resolve_elastic_batch
from dsrun.config.migrate import LegacyConfigWarning, migrate_legacy
from dsrun.config.model import DSConfig
from dsrun.config.problems import split_unknown_top_level, validate_model
from dsrun.config.rules import check_rules
from dsrun.config.sections import ResolvedDsConfig, ds_section, typed_config
from dsrun.config.sources import ConfigSource, read_config_source
from dsrun.config.support import announce, check_support
from dsrun.config.zero import shard_problems

__all__ = [
    "DSConfig",
    "ResolvedDsConfig",
    "announce",
    "ds_section",
    "load_resolved",
    "parse_count",
    "typed_config",
    "LegacyConfigWarning",
    "load_ds_config",
    "read_config_source",
    "validate_ds_config",
]

logger = logging.getLogger("dsrun.config")
_parses = [0]


def parse_count() -> int:
    """How many times this process has parsed a whole DeepSpeed config (:func:`load_ds_config` and
    :func:`validate_ds_config` each count one)."""
    return _parses[0]


def _analyse(
    source: ConfigSource | DSConfig,
    world_size: int | None,
    world_size_source: str,
    auto_values: Mapping[str, Any] | None,
    path_prefix: str,
) -> tuple[DSConfig | None, list[Problem]]:
    _parses[0] += 1
    prefix = f"{path_prefix.rstrip('.')}." if path_prefix else ""
    if isinstance(source, DSConfig):
        source = source.to_ds_dict()
    try:
        raw = read_config_source(source)
    except ConfigError as err:
        return None, list(err.problems)

    data, problems, notes = migrate_legacy(raw, prefix)
    data, ignored = split_unknown_top_level(DSConfig, data)
    if ignored:
        note = (f"{path_prefix or 'config'}: unknown top-level key(s) {', '.join(map(repr, ignored))} ignored, "
                "as DeepSpeed ignores them")
        notes.append(note)
        logger.warning("%s", note)
    data, auto_problems, auto_batch = resolve_auto(data, auto_values, prefix)
    problems += auto_problems

    model, schema_problems = validate_model(DSConfig, data, prefix.rstrip("."))
    problems += schema_problems
    failed_sections = {pr.path[len(prefix):].split(".")[0].split("[")[0] for pr in schema_problems}
    if model is None:
        # Validate what is left so the batch and cross-field checks still report their problems.
        partial = {k: v for k, v in data.items() if k not in failed_sections}
        model, _ = validate_model(DSConfig, partial, prefix.rstrip("."))
    if model is None:  # pragma: no cover - the partial dict holds only keys that validated
        return None, problems
    assert isinstance(model, DSConfig)

    batch_failed = failed_sections & {TBS, MBS, GAS, "elasticity", "sequence_parallel_size"}
    resolution: BatchResolution | None = None
    sp = int(model.sequence_parallel_size)
    if world_size is not None:  # ZeRO's MiCS/hpZ groups cut the whole data group (sequence ranks included)
        problems += shard_problems(model.zero_optimization, world_size, prefix)
    if world_size is not None and sp > 1:  # Ulysses: a sequence group of sp ranks holds one replica's samples
        if world_size % sp:
            problems.append(Problem(f"{prefix}sequence_parallel_size", f"{sp} does not divide the data-parallel "
                                    f"world size {world_size}", "pick a divisor of the number of ranks"))
            batch_failed = {"sequence_parallel_size"}
        world_size, world_size_source = world_size // sp, f"{world_size_source} / sequence_parallel_size {sp}"
    if world_size is not None and model.data_parallel_size is not None and model.data_parallel_size != world_size:
        problems.append(Problem(f"{prefix}data_parallel_size", f"is {model.data_parallel_size}, but the world holds "
                                f"{world_size} data-parallel replicas ({world_size_source})",
                                f"set it to {world_size}, or drop it (the mesh is data x sequence_parallel_size)"))
    if world_size is None:  # the data-parallel size is not known here (dsrun launch): initialize checks it
        auto_batch = []
    elif not batch_failed:
        if model.elasticity.enabled:
            resolution, batch_problems = resolve_elastic_batch(model, data, world_size, world_size_source, prefix)
        else:
            resolution, batch_problems = resolve_batch(
                model.train_batch_size, model.train_micro_batch_size_per_gpu, model.gradient_accumulation_steps,
                world_size, world_size_source, prefix)
        if not batch_problems:
            auto_batch = []
        auto_paths = {f"{prefix}{key}" for key in auto_batch}
        problems += batch_problems if not auto_paths else [
            Problem(path, "\"auto\" cannot be resolved: the batch sizes given do not determine it",
                    "write a number, or let the runner supply it") for path in sorted(auto_paths)
        ] + [pr for pr in batch_problems if pr.path not in auto_paths]

    rule_problems, rule_notes = check_rules(model, data, prefix)
    problems += [pr for pr in rule_problems if pr.path[len(prefix):].split(".")[0] not in failed_sections]
    notes += rule_notes
    for note in rule_notes:
        logger.info("%s", note)
    support_problems, allowed = check_support(model, prefix)
    problems += support_problems

    if problems:
        # A key reported as an unresolvable "auto" is not reported again as missing.
        auto_reported = {pr.path for pr in auto_problems}
        problems = auto_problems + [pr for pr in problems if pr.path not in auto_reported]
        return None, _unique(problems)
    if resolution is not None:
        model = model.model_copy(update={
            TBS: resolution.train_batch_size,
            MBS: resolution.train_micro_batch_size_per_gpu,
            GAS: resolution.gradient_accumulation_steps,
        })
        model._batch_explanation = resolution.explanation
        model._world_size = world_size
    model._world_size_source = world_size_source
    model._warnings = notes
    model._unimplemented = [(u.path, u.warning(prefix)) for u in allowed]
    return model, []


def _unique(problems: list[Problem]) -> list[Problem]:
    seen: set[tuple[str, str]] = set()
    out = []
    for problem in problems:
        if (problem.path, problem.message) not in seen:
            seen.add((problem.path, problem.message))
            out.append(problem)
    return out


def load_ds_config(
    source: ConfigSource | DSConfig,
    world_size: int | None = 1,
    *,
    world_size_source: str = "default",
    auto_values: Mapping[str, Any] | None = None,
    path_prefix: str = "",
) -> DSConfig:
    """Read, migrate, validate and resolve a DeepSpeed config.

    ``source``: a dict, a path (``.json``/``.hjson``/``.yaml``/``.yml``), JSON text, or base64 JSON.
    ``world_size`` is the data-parallel size used for the batch arithmetic; ``world_size_source`` says where
    it came from (shown in errors and :attr:`DSConfig.batch_explanation`); None skips the batch
    arithmetic (a launcher that does not know the data-parallel size; the batch keys stay as given).
    ``auto_values`` maps
    dotted keys (relative to the config root, e.g. ``"optimizer.params.lr"``) to the values that replace
    ``"auto"``. ``path_prefix`` is put before every key path in problems (``"ds"`` gives
    ``ds.zero_optimization.stage``).

    Raises :class:`~dsrun.utils.errors.ConfigError` listing every problem. Legacy keys are migrated with a
    :class:`LegacyConfigWarning`. A key the config enables that dsrun does not implement (the support ledger,
    :mod:`dsrun.config.support`) is a problem, or with ``dsrun_allow_unimplemented: true`` a warning line in
    :attr:`DSConfig.unimplemented_warnings` (:func:`announce` prints them once per run).
    """
    model, problems = _analyse(source, world_size, world_size_source, auto_values, path_prefix)
    if problems:
        raise ConfigError(problems)
    assert model is not None
    return model


def validate_ds_config(
    source: ConfigSource | DSConfig,
    world_size: int | None = 1,
    *,
    world_size_source: str = "default",
    auto_values: Mapping[str, Any] | None = None,
    path_prefix: str = "",
) -> list[Problem]:
    """The same checks as :func:`load_ds_config`; returns the problems (empty when valid), never raises
    for a bad config."""
    return _analyse(source, world_size, world_size_source, auto_values, path_prefix)[1]


#: the ``world_size_source`` of a rank's parse, in errors (as ``dsrun.initialize`` says it)
RANK_WORLD_SOURCE = "data-parallel world size"


def load_resolved(source: Mapping[str, Any], world_size: int) -> ResolvedDsConfig:
    """A rank's one parse: ``source`` (the resolved config the launcher wrote) with its typed config for
    ``world_size`` data-parallel ranks (an elastic job's ranks may run at another world size than the launcher
    resolved for: the batch sizes are resolved again here). ``dsrun.initialize`` at that world size uses it as is."""
    return ResolvedDsConfig(source, load_ds_config(dict(source), world_size=world_size,
                                                   world_size_source=RANK_WORLD_SOURCE), world_size)
