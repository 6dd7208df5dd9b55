"""Checks ``dsrun train`` makes before any rank starts, so a mistake costs one line and no launch.

What the ranks would otherwise find one traceback per rank later:

* a value a config group leaves unset (``???``, e.g. ``data.path`` of ``data=text``);
* dsrun's own data: the files exist, the token ids fit the model's vocabulary, ``data.seq_len`` fits the
  model's ``block_size`` (the corpus is built here once, which also fills the token cache for the ranks);
* the model's shape rules (``n_head`` divides ``n_embd``, ...): the model is built on the meta device;
* ``train.resume``: the checkpoint exists, its ``latest`` names a tag folder that exists, and its files are
  whole (a truncated file has no zip directory);
* monitor folders the user named can be written;
* memory: the estimator's peak for this run against this machine (``dsrun estimate-memory`` shows the
  breakdown); "too big" stops the launch (``--skip-memory-check`` launches anyway), "tight" is a note;
* ``train.preemption.grace_s`` against the time this run's checkpoint takes to write here (its size by the
  estimator over the write rate measured in the directory ``dsrun train`` runs from, measured only when the
  grace asks for more than any disk gives: :data:`ANY_DISK_BYTES_PER_S`): a preempted run could not save. A
  grace period you set is refused; the default one (120 s) gets a note, so a run that no scheduler preempts
  is not stopped for it.

Files and memory are checked only when every rank runs on this machine: a plan with other hosts may read
paths this machine does not have.

:func:`check_before_launch` raises :class:`~dsrun.utils.errors.UserError` listing every problem, and returns
the notes to print (e.g. a warm-up longer than the run) with what the run record keeps (the data's digest).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from dsrun.runspec import PreemptionSpec
from dsrun.utils.errors import Problem, UserError, find_user_error

if TYPE_CHECKING:
    from dsrun.config import DSConfig
    from dsrun.data.corpus import TokenCorpus
    from dsrun.estimate.inputs import EstimateInputs
    from dsrun.estimate.runspec import RecipeModel
    from dsrun.launcher import LaunchPlan
    from dsrun.runspec import ResolvedRun

WARMUP_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
ANY_DISK_BYTES_PER_S = 50 * 2**20  # a grace that needs no faster writes than this is not measured
WRITE_PROBE_BYTES = 64 * 2**20  # at most this much is written (and synced) to measure the rate


@dataclass
class Preflight:
    """What the checks found that is not an error: ``notes`` (one line each, printed before the launch),
    ``memory`` (the estimator's verdict in words, None when not checked) and ``data`` (the data's digest
    for the run record, None when dsrun did not build the data), and ``model`` (the recipe's model as the checks
    built it, for ``--dry-run``'s one-rank fit check; None when it could not be built)."""

    notes: list[str] = field(default_factory=list)
    memory: str | None = None
    data: dict[str, Any] | None = None
    model: RecipeModel | None = None


def check_before_launch(resolved: ResolvedRun, *, memory_check: bool = True) -> Preflight:
    """Every check of the module docstring on a :class:`~dsrun.runspec.ResolvedRun`; raises
    :class:`UserError` with all problems found."""
    spec: DictConfig = resolved.runspec
    missing = missing_values(spec)
    if missing:  # the other checks would trip over the unset values
        raise UserError(missing)
    result = Preflight()
    problems: list[Problem] = []
    model = _build_model(spec, problems, result)
    here = runs_here(resolved.plan)  # files and memory of other machines are not ours to check
    corpus = _build_data(spec, problems) if here else None
    if corpus is not None:
        result.data = data_digest(corpus)
        if model is not None:
            problems += fit_checks(corpus, getattr(model.module, "config", None))
    if here:
        problems += resume_problems(resolved.train.resume)
        problems += monitor_path_problems(resolved.ds)
    if not problems and model is not None and memory_check and here:
        problems += _memory(resolved, model, result)
    if not problems and model is not None and here:  # the default grace period gets a note, one you set a refusal
        too_short = grace_problems(resolved, model, Path.cwd())
        if resolved.train.preemption.grace_s != PreemptionSpec().grace_s:
            problems += too_short
        else:
            result.notes += [f"note: a preemption could not save in time: {problem}" for problem in too_short]
    result.model = model
    if problems:
        raise UserError(problems)
    note = warmup_note(resolved)
    if note:
        result.notes.append(note)
    return result


def runs_here(plan: LaunchPlan) -> bool:
    """True when every rank of the plan runs on this machine."""
    return all(host in ("localhost", "127.0.0.1") for host in plan.hosts)


def missing_values(spec: DictConfig) -> list[Problem]:
    """One problem per ``???`` left in the RunSpec (``ds`` is checked by the DeepSpeed schema)."""
    return [Problem(key, "has no value (the config leaves it '???')", f"set it on the command line: {key}=...")
            for key in sorted(OmegaConf.missing_keys(spec)) if not key.startswith("ds.")]


def _build_model(spec: DictConfig, problems: list[Problem], result: Preflight) -> RecipeModel | None:
    """The recipe's model on the meta device (its constructor checks its shape), or None."""
    from dsrun.estimate.runspec import build_recipe_model
    from dsrun.tensor_parallel.spec_split import meta_split_for

    try:
        return build_recipe_model(spec, split=meta_split_for(spec))  # with AutoTP: one rank's share
    except Exception as err:  # noqa: BLE001 - a user's model class that cannot be built on meta: the ranks will say
        user = find_user_error(err)
        if user is not None:
            problems += user.problems
            return None
        cause = err
        while cause.__cause__ is not None:  # hydra's InstantiationException wraps the constructor's error
            cause = cause.__cause__
        text = " ".join(str(cause).split())
        result.notes.append(f"memory not checked: the model could not be built on the meta device "
                            f"({type(cause).__name__}: {text[:200]})")
    return None


def _build_data(spec: DictConfig, problems: list[Problem]) -> TokenCorpus | None:
    """dsrun's own corpora, built once here (a user's ``_target_`` may need the ranks: it is left to them)."""
    import hydra.utils

    if not str(spec.data.get("_target_", "")).startswith("dsrun.data."):
        return None
    try:
        return hydra.utils.instantiate(spec.data, _convert_="all")
    except Exception as err:
        user = find_user_error(err)
        if user is None:
            raise
        problems += user.problems
    return None


def fit_checks(corpus: TokenCorpus, model_config: object) -> list[Problem]:
    """The data against the model: the sequence length fits its context, the ids fit its vocabulary.
    ``model_config`` is any model's config (or None): its ``block_size`` and ``vocab_size`` are read when present."""
    problems: list[Problem] = []
    block_size = getattr(model_config, "block_size", None)
    if isinstance(block_size, int) and corpus.seq_len > block_size:
        problems.append(Problem("data.seq_len", f"{corpus.seq_len} exceeds model.block_size={block_size}",
                                "lower data.seq_len or raise model.block_size"))
    vocab_size = getattr(model_config, "vocab_size", None)
    if isinstance(vocab_size, int):
        try:
            corpus.check_vocab(vocab_size)
        except UserError as err:
            problems += err.problems
    return problems


def data_digest(corpus: TokenCorpus, limit: int = 256 * 2**20) -> dict[str, Any]:
    """A SHA-256 of the corpus's train and eval tokens (``how``: "full"), or for arrays over ``limit`` bytes
    of their size and three 16 MiB slices (``how``: "sampled"), so a 100 GB token file costs no minutes."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    arrays = (corpus.train_tokens, corpus.eval_tokens)
    total = sum(a.nbytes for a in arrays)
    sampled = total > limit
    for array in arrays:
        flat = np.asarray(array).reshape(-1)
        digest.update(f"{flat.dtype.str}:{len(flat)};".encode())
        chunk = max(1, (16 * 2**20) // flat.itemsize)
        starts = (0, max(0, len(flat) // 2 - chunk // 2), max(0, len(flat) - chunk)) if sampled else (0,)
        for start in starts:
            piece = flat[start:start + chunk] if sampled else flat
            digest.update(memoryview(np.ascontiguousarray(piece)).cast("B"))
    return {"sha256": digest.hexdigest(), "how": "sampled" if sampled else "full", "bytes": int(total),
            "description": corpus.description}


def resume_problems(resume: str | None) -> list[Problem]:
    """``train.resume`` names a checkpoint that exists, whose ``latest`` names an existing tag folder
    (:func:`dsrun.checkpoint.training.latest_tag`), and whose files are whole. ``auto`` and null need nothing
    here."""
    from dsrun.checkpoint import layout
    from dsrun.checkpoint.training import find_checkpoint
    from dsrun.utils.zero_to_fp32 import file_problem

    if resume is None or str(resume).lower() in ("", "none", "null", "false", "auto"):
        return []
    try:
        found = find_checkpoint(resume, Path.cwd())
    except UserError as err:
        return list(err.problems)
    if found is None:
        return []
    folder, tag = found  # find_checkpoint refused a `latest` that names no tag folder
    tag_dir = layout.resolve_tag_dir(folder, str(tag or layout.read_latest(folder)))
    problems = []
    for path in sorted(tag_dir.glob("*.pt")):
        reason = file_problem(str(path))
        if reason:
            problems.append(Problem("train.resume", f"{path} is not a whole checkpoint file ({reason})",
                                    "resume from an earlier tag (pass its folder) or start fresh: train.resume=null"))
    return problems


def monitor_path_problems(ds: DSConfig) -> list[Problem]:
    """Folders named in ``csv_monitor`` / ``tensorboard`` ``output_path`` that cannot be created or written."""
    problems = []
    for section in ("csv_monitor", "tensorboard"):
        config = getattr(ds, section, None)
        path = getattr(config, "output_path", None) if config is not None else None
        if not config or not config.enabled or not path:
            continue
        reason = unwritable(Path(path).expanduser())
        if reason:
            problems.append(Problem(f"ds.{section}.output_path", f"cannot write to {path} ({reason})",
                                    "pick a folder you can write to, or leave it empty for the run directory"))
    return problems


def unwritable(path: Path) -> str | None:
    """Why files cannot be written below ``path`` (made if missing), without making anything; else None."""
    probe = path.absolute()
    while not probe.exists():
        if probe.parent == probe:
            return "no part of the path exists"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def warmup_note(resolved: ResolvedRun) -> str | None:
    """A note when a warm-up schedule warms up for longer than the run lasts (its peak lr is never reached)."""
    scheduler = resolved.ds.scheduler
    if scheduler.type not in WARMUP_SCHEDULES:
        return None
    params = dict(scheduler.params or {})
    warmup = int(params.get("warmup_num_steps", 1000))
    steps = resolved.train.max_steps
    if resolved.train.max_tokens:
        tokens_per_step = resolved.ds.train_batch_size * int(OmegaConf.select(resolved.runspec, "data.seq_len") or 1)
        steps = min(steps, math.ceil(resolved.train.max_tokens / tokens_per_step))
    if params.get("total_num_steps"):
        steps = min(steps, int(params["total_num_steps"]))
    if warmup <= steps:
        return None
    return (f"note: ds.scheduler.params.warmup_num_steps={warmup} is more than the {steps} steps this run "
            f"takes: the learning rate never leaves {scheduler.type}'s warm-up")


def _memory(resolved: ResolvedRun, model: RecipeModel, result: Preflight) -> list[Problem]:
    """The estimator's verdict for this run on this machine (all ranks local); "too big" is a problem."""
    from dsrun.estimate import estimate_peak_bytes_per_rank
    from dsrun.estimate.verdict import NO_FIT, TIGHT, detect_budget, judge

    spec = _host_inputs(resolved, model)
    model_cfg = OmegaConf.to_container(resolved.runspec.model, resolve=True)
    ds_cfg = OmegaConf.to_container(resolved.runspec.ds, resolve=True)
    runtime, monitors = _cached_rank_runtime(spec, model_cfg, ds_cfg)
    verdict = judge(estimate_peak_bytes_per_rank(spec.with_(rank_runtime_bytes=runtime, monitor_bytes=monitors)),
                    detect_budget())
    # the figure is dsrun estimate-memory's once that has measured an idle rank here; until then it says that
    # it leaves the rank's own process out (the same run's two figures used to differ without a word)
    what = (f"estimate incl. each rank's idle process, {runtime / 2**30:.2f} GiB as dsrun estimate-memory "
            f"measured it here" if runtime else
            "estimate, a lower bound: each rank's own process (interpreter, torch) is left out until dsrun "
            "estimate-memory with the same overrides has measured it here once")
    result.memory = f"{verdict.level}: {verdict.reason}; {what}"
    if verdict.level == TIGHT:
        result.notes.append(f"note: memory is tight ({verdict.reason}); dsrun estimate-memory shows the breakdown")
    if verdict.level != NO_FIT:
        return []
    return [Problem("memory", f"this run does not fit this machine by the estimator: {verdict.reason}",
                    "see dsrun estimate-memory with the same overrides; try zero=stage3 offload=cpu, a smaller "
                    "model, or fewer ranks; --skip-memory-check launches anyway")]


def grace_problems(resolved: ResolvedRun, model: RecipeModel, where: Path) -> list[Problem]:
    """``train.preemption.grace_s`` shorter than writing this run's checkpoint takes in ``where`` (its size by
    :func:`~dsrun.estimate.model_states.checkpoint_bytes`, the rate measured there by :func:`write_rate` when the
    grace asks for more than :data:`ANY_DISK_BYTES_PER_S`): a preempted run could not save in time."""
    from dsrun.estimate.model_states import checkpoint_bytes
    from dsrun.estimate.runspec import inputs_from_runspec

    grace = resolved.train.preemption.grace_s
    size = checkpoint_bytes(inputs_from_runspec(resolved.runspec, model)[0])
    if size <= grace * ANY_DISK_BYTES_PER_S:
        return []
    try:
        rate, probe_dir = write_rate(where, min(size, WRITE_PROBE_BYTES))
    except OSError:  # nothing can be written there: the run directory's own check says so
        return []
    seconds = size / rate
    if seconds <= grace:
        return []
    return [Problem("train.preemption.grace_s", f"is {grace:g} s, but saving this run's checkpoint "
                    f"({size / 2**20:,.1f} MiB of weights and optimizer states) takes about {seconds:.3g} s here "
                    f"(writing {rate / 2**20:,.0f} MiB/s, measured in {probe_dir})",
                    f"raise it to at least {math.ceil(seconds * 1.5)} and give the scheduler's notice as long "
                    "(Kubernetes: terminationGracePeriodSeconds; Slurm: --signal=USR1@SECONDS), or save to a "
                    "faster disk")]


def write_rate(where: Path, size: int) -> tuple[float, Path]:
    """(bytes per second, the folder measured): ``size`` bytes written and synced to a file in the nearest existing
    folder of ``where``, then removed."""
    import tempfile
    import time

    folder = where.absolute()
    while not folder.is_dir():
        folder = folder.parent
    chunk = b"\0" * min(size, 4 * 2**20)
    started = time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".dsrun-write-rate-") as handle:
        written = 0
        while written < size:
            written += handle.write(chunk[:size - written])
        handle.flush()
        os.fsync(handle.fileno())
        elapsed = time.perf_counter() - started
    return written / max(elapsed, 1e-6), folder


def _host_inputs(resolved: ResolvedRun, model: RecipeModel) -> EstimateInputs:
    """The estimator's inputs for this run's plan on this host's device (CUDA where torch sees one, else the
    CPU), as ``dsrun estimate-memory`` reads them: its CPU-only terms (stage 3's gather pool, gloo's
    temporaries) count here exactly when they count there."""
    import torch

    from dsrun.estimate.runspec import inputs_from_runspec

    slots = [len(s) for s in resolved.plan.hosts.values()] or [resolved.plan.world_size]
    spec, _ = inputs_from_runspec(resolved.runspec, model)
    return spec.with_(nodes=len(slots), ranks_per_node=max(slots),
                      device="cuda" if torch.cuda.is_available() else "cpu")


def one_rank_too_big(resolved: ResolvedRun, model: RecipeModel) -> str | None:
    """Why one rank of the plan (its share of the model, its optimizer states) does not fit this machine by the
    estimator, or None: ``--dry-run`` builds every rank's engine here, one at a time."""
    from dsrun.estimate import estimate_peak_bytes_per_rank
    from dsrun.estimate.verdict import detect_budget

    rank = estimate_peak_bytes_per_rank(_host_inputs(resolved, model))
    budget, gib = detect_budget(), 2**30
    if budget.device_total is not None and rank.peak_per_rank > budget.device_total:
        return f"one rank needs {rank.peak_per_rank / gib:.2f} GiB of {budget.device_name}'s " \
               f"{budget.device_total / gib:.2f} GiB"
    need = max(rank.peak_per_rank + rank.host_per_rank, rank.init_per_rank) if budget.device_total is None \
        else rank.host_peak_per_rank
    if need > budget.host_available:
        return f"one rank needs {need / gib:.2f} GiB of RAM, {budget.host_available / gib:.2f} GiB are free"
    return None


def _cached_rank_runtime(spec: EstimateInputs, model_cfg: dict[str, Any], ds_cfg: Any) -> tuple[int, int]:
    """An idle rank's measured memory and what rank 0's monitors add, when ``dsrun estimate-memory`` measured
    them on this host before (the measurement takes seconds, so train does not make it), else (0, 0): the
    estimate is then a lower bound."""
    from dsrun.estimate.runtime import cached_rank_runtime, enabled_monitors, rank_threads

    runtime = cached_rank_runtime(rank_threads(spec.ranks_per_node), spec.optimizer, model_cfg, spec.precision,
                                  enabled_monitors(ds_cfg if isinstance(ds_cfg, dict) else None))
    return (0, 0) if runtime is None else (runtime.resident, runtime.monitors)
