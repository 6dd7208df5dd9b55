"""Where ``dsrun train`` resumes from: ``train.resume=auto`` across earlier runs, and ``--from RUN_DIR``.

Every run gets a fresh directory, so "the latest checkpoint of this run" is never in it. ``train.resume=auto``
therefore looks through the earlier run directories beside it (``outputs/*/*``, or ``multirun/*/*/*`` for a
sweep's job) for runs started with the same recipe and overrides, and resumes from the newest checkpoint
among them; it says where it looked when it finds none. Overrides that say how long a run lasts or how it is
bookkept, not what it trains, do not count (:data:`NOT_SHAPING`), so ``train.max_steps=600 train.resume=auto``
continues a 300-step run.

``dsrun train --from RUN_DIR [OVERRIDES]`` composes from the run directory's record of its composition
(``.hydra/config.yaml``) and resumes from its newest checkpoint, or, when it has none or had finished (then
raise ``train.max_steps`` to continue it), runs it again from where it started: the checkpoint it resumed
from, else step 0.

Both read a checkpoint folder by one rule, that of ``train.resume=PATH``
(:func:`dsrun.checkpoint.training.latest_tag`): ``latest`` names the checkpoint; a damaged one (missing beside
tag folders, empty, naming a folder that does not exist) is refused with the newest complete tag to resume
from, never taken for "no checkpoint". ``train.resume=auto`` that finds a finished run says so and launches
nothing.

Either way the resolved ``train.resume`` (a folder, or null) is what ``resolved.yaml`` records.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from omegaconf import OmegaConf

from dsrun.rundir import PROVENANCE_JSON, RESOLVED_YAML
from dsrun.utils.errors import Problem, UserError

if TYPE_CHECKING:
    from dsrun.runspec import ResolvedRun

NOT_SHAPING = ("train.resume", "train.max_steps", "train.max_tokens", "train.save_interval", "train.keep_last",
               "train.eval_interval", "train.eval_iters", "train.preemption.grace_s", "launcher.master_port",
               "launcher.master_addr", "launcher.log_dir", "ds.steps_per_print", "checkpoint",
               "ds.checkpoint.writer.decoupled")
CHECKPOINTS = "checkpoints"


def override_key(text: str) -> str:
    return text.lstrip("+~").split("=", 1)[0]


def shaping_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` without those of :data:`NOT_SHAPING` and Hydra's own, sorted (order does not matter)."""
    return sorted(o for o in overrides
                  if override_key(o) not in NOT_SHAPING and not override_key(o).startswith("hydra."))


def with_resume(resolved: ResolvedRun, value: str | None) -> ResolvedRun:
    """``resolved`` with ``train.resume`` set to ``value``."""
    spec = copy.deepcopy(resolved.runspec)
    spec.train.resume = value
    return dataclasses.replace(resolved, runspec=spec, train=resolved.train.model_copy(update={"resume": value}))


def checkpoint_step(folder: Path, key: str = "train.resume", command: str = "") -> tuple[str, int | None] | None:
    """(tag, step) of the checkpoint ``folder/latest`` names (step None when the tag does not end in a number),
    None when ``folder`` holds no checkpoint; a damaged ``latest`` is refused as ``train.resume=PATH`` refuses
    it (:func:`dsrun.checkpoint.training.latest_tag`: ``key``, ``command``)."""
    from dsrun.checkpoint.training import latest_tag

    tag = latest_tag(folder, key, command)
    if tag is None:
        return None
    match = re.search(r"(\d+)$", tag)
    return tag, int(match.group(1)) if match else None


def effective_overrides(overrides: Sequence[str]) -> list[str]:
    """One override per key, the last one given winning (``--from`` adds its overrides to its source's)."""
    return list({override_key(o): o for o in overrides}.values())


def recorded_overrides(run_dir: Path) -> list[str] | None:
    """The overrides a run was started with: its ``provenance.json`` record (which adds a ``--from`` run's
    overrides to its source's), else Hydra's ``.hydra/overrides.yaml``; None for a folder that is no run."""
    import json

    try:
        return list(json.loads((run_dir / PROVENANCE_JSON).read_text())["overrides"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return [str(o) for o in OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")]
    except (OSError, ValueError, TypeError):
        return None


class RunFinished(Exception):
    """``train.resume=auto`` found that the run it would continue has trained all its steps: nothing to
    launch. ``run_dir``: that run; the message says so in one line."""

    def __init__(self, run_dir: Path, line: str) -> None:
        super().__init__(line)
        self.run_dir = run_dir

    def final_eval_loss(self) -> float | None:
        """The finished run's result (a sweep's job reports it as its own)."""
        import json

        from dsrun.rundir import METRICS_JSON

        try:
            return json.loads((self.run_dir / METRICS_JSON).read_text()).get("final_eval_loss")
        except (OSError, ValueError, AttributeError):
            return None


def settle_auto(resolved: ResolvedRun, run_dir: Path, overrides: Sequence[str],
                multirun: bool) -> tuple[ResolvedRun, str]:
    """Resolve ``train.resume=auto`` for the job in ``run_dir`` started with ``overrides``: (the run with
    ``train.resume`` set to the checkpoint folder found, or null; the line that says what was found)."""
    depth = 3 if multirun else 2
    root = run_dir.parents[depth - 1]
    mine = shaping_overrides(overrides)
    looked, found = 0, []
    for other in root.glob("/".join("*" * depth)):
        recorded = recorded_overrides(other) if other != run_dir else None
        if recorded is None:
            continue
        looked += 1
        checkpoint = checkpoint_step(other / CHECKPOINTS) if shaping_overrides(recorded) == mine else None
        # (a damaged `latest` in a run that matches is refused: it may be the newest)
        if checkpoint is not None:
            found.append(((other / CHECKPOINTS / "latest").stat().st_mtime, other / CHECKPOINTS, checkpoint))
    if not found:
        saving = "" if resolved.train.save_interval else " (train.save_interval=0: this run saves none either)"
        return with_resume(resolved, None), (
            f"train.resume=auto: no checkpoint of an earlier run with the same recipe and overrides among the "
            f"{looked} run directories in {root}; starting from step 0{saving}")
    _, folder, (tag, step) = max(found, key=lambda item: item[0])
    at = f" at step {step}" if step is not None else ""
    if step is not None and step >= resolved.train.max_steps:
        raise RunFinished(folder.parent, (
            f"train.resume=auto: the newest run with the same recipe and overrides, {folder.parent}, finished: "
            f"its checkpoint {tag} is at step {step} of train.max_steps={resolved.train.max_steps}; nothing to "
            f"train (raise train.max_steps to train it longer, e.g. train.max_steps={2 * step})"))
    return with_resume(resolved, str(folder)), (
        f"train.resume=auto: resuming from {folder / tag}{at}, the newest checkpoint of an earlier run with the "
        "same recipe and overrides")


def settle_requeued(resolved: ResolvedRun, run_dir: Path) -> tuple[ResolvedRun, str] | None:
    """A submitted job that a scheduler runs again (requeued after the time-limit notice or a preemption) runs in
    the same run directory: the run resumes from that directory's newest checkpoint, its own from before it was
    stopped. None when it holds none (the job's first run)."""
    folder = run_dir / CHECKPOINTS
    found = checkpoint_step(folder)
    if found is None:
        return None
    tag, step = found
    if step is not None and step >= resolved.train.max_steps:
        raise RunFinished(run_dir, f"requeued job: its run directory's checkpoint {tag} is at step {step} of "
                          f"train.max_steps={resolved.train.max_steps}; nothing left to train")
    at = f" at step {step}" if step is not None else ""
    return with_resume(resolved, str(folder)), (
        f"requeued job: resuming from {folder / tag}{at}, its own checkpoint from before it was stopped")


def source_run(path: str | Path) -> Path:
    """The run directory ``--from`` names, checked to hold dsrun's record of a composition."""
    source = Path(path).expanduser().absolute()
    if not (source / ".hydra" / "config.yaml").is_file():
        raise UserError(Problem("--from", f"{path} is not a dsrun run directory (no .hydra/config.yaml in it)",
                                "pass a run's folder, e.g. outputs/2026-01-31/12-00-00"))
    return source


def from_overrides(source: Path, overrides: Sequence[str]) -> list[str]:
    """The overrides of a ``--from`` run: a DeepSpeed file given to the source run by a relative path is found
    where that run was started, then the user's overrides."""
    config = OmegaConf.load(source / ".hydra" / "config.yaml")
    extra = []
    ds_config = config.get("ds_config")
    if ds_config and not Path(str(ds_config)).is_absolute():
        from dsrun.monitor.run_defaults import launch_dir

        extra.append(f"ds_config={launch_dir(source) / str(ds_config)}")
    return [*extra, *overrides]


def started_from(source: Path) -> str | None:
    """The checkpoint folder a run resumed from, as its ``resolved.yaml`` records it, when it still holds a
    checkpoint; None for a run that started from step 0."""
    try:
        resume = OmegaConf.select(OmegaConf.load(source / RESOLVED_YAML), "train.resume")
    except (OSError, ValueError):
        return None
    if not resume or str(resume).lower() in ("none", "null", "false", "auto"):
        return None
    return str(resume) if Path(str(resume)).exists() else None


def settle_from(resolved: ResolvedRun, source: Path, overrides: Sequence[str]) -> tuple[ResolvedRun, str]:
    """Resume a ``--from`` run from the source's newest checkpoint, unless the user set ``train.resume``;
    when the source has none, or had finished, run it again from where it started (the checkpoint it
    resumed from, else step 0): (the run, the line that says which)."""
    if any(override_key(o) == "train.resume" for o in overrides):
        return resolved, f"rerunning {source} with train.resume={resolved.train.resume}"
    checkpoint = checkpoint_step(source / CHECKPOINTS, "--from", f"dsrun train --from {source} ")
    steps = resolved.train.max_steps
    if checkpoint is not None and (checkpoint[1] is None or checkpoint[1] < steps):
        tag, step = checkpoint
        at = f" at step {step}" if step is not None else ""
        return with_resume(resolved, str(source / CHECKPOINTS)), (
            f"resuming {source} from its checkpoint {tag}{at} (of {steps} steps)")
    why = ("it has no checkpoint" if checkpoint is None else
           f"its checkpoint {checkpoint[0]} is at the end of its {steps} steps; raise train.max_steps to continue it")
    origin = started_from(source)
    where = f"from {origin}, the checkpoint it started from" if origin else "from step 0"
    return with_resume(resolved, origin), f"rerunning {source} {where} ({why})"
