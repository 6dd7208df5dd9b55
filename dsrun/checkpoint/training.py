"""Checkpoints for ``dsrun train``: resume before the first step, save every ``train.save_interval`` steps into
``RUN_DIR/checkpoints`` and at the run's last step (so a run whose length is no multiple of the interval keeps
its last steps too), keep the newest ``train.keep_last``.

``train.resume``: ``null`` starts fresh; ``auto`` resumes from ``RUN_DIR/checkpoints`` when it holds a
checkpoint (else starts fresh); a path resumes from that checkpoint folder (the one holding ``latest``), from
a run directory's ``checkpoints/`` folder, or from one tag's folder (``.../checkpoints/global_step400``), and
it is an error if there is nothing to resume from. Ranks restarted within a run (elastic training, restarts
after a failure) resume from the run's own newest checkpoint instead, or from the one the engine that restarted
them registered (Ray Train's, ``restart_from``). A preempted run (SIGTERM, SIGUSR1) saves
where it stops even with ``train.save_interval=0``.
The data loader's position travels in the checkpoint's client state, so a resumed run reads the very batches
the interrupted one would have.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from dsrun import comm
from dsrun.utils.errors import Problem, UserError

from . import atomic, layout

CHECKPOINTS_DIR = "checkpoints"
LOADER_KEY = "data_loader"


def latest_tag(save_dir: Path, key: str = "train.resume", command: str = "") -> str | None:
    """The tag ``save_dir/latest`` names, checked. None when ``save_dir`` holds no checkpoint at all (no
    ``latest``, no tag folders). A ``latest`` that is missing beside tag folders, empty, or names a tag folder
    that does not exist is refused (UserError under ``key``), naming the newest complete tag and how to resume
    from it (``command`` precedes ``train.resume=`` there). The one rule of ``train.resume=PATH``,
    ``train.resume=auto`` and ``dsrun train --from``: never a silent restart from step 0 or from a guess."""
    tag = layout.read_latest(save_dir)
    if tag is not None and layout.resolve_tag_dir(save_dir, tag) is not None:
        return tag
    latest, tags = save_dir / layout.LATEST, layout.list_tags(save_dir)
    if not tags and not latest.exists():
        return None
    why = (f"{latest} names tag {tag!r}, but {save_dir / tag} does not exist" if tag is not None else
           f"{latest} is {'empty' if latest.exists() else 'missing'}")
    hint = (f"resume from the newest complete one: {command}train.resume={save_dir / tags[-1]}, or write an "
            f"existing tag into {latest}" if tags else f"start from step 0: {command}train.resume=null")
    raise UserError(Problem(key, f"{why} (complete tags there: {', '.join(tags) or 'none'})", hint))


def find_checkpoint(resume: str | None, run_dir: Path) -> tuple[Path, str | None] | None:
    """``(checkpoint folder, tag or None for latest)`` to resume from, or None to start fresh."""
    if resume is None or str(resume).lower() in ("", "none", "null", "false"):
        return None
    if str(resume).lower() == "auto":
        own = run_dir / CHECKPOINTS_DIR
        return (own, None) if layout.read_latest(own) else None
    given = Path(resume).expanduser()
    for candidate in (given, given / CHECKPOINTS_DIR):
        if latest_tag(candidate) is not None:
            return candidate, None
    if given.is_dir() and any(given.glob("*model_states.pt")):  # one tag's folder: resume from that tag
        return given.parent, given.name
    raise UserError(Problem("train.resume", f"no checkpoint at {given} (looked for {given / layout.LATEST}, "
                            f"{given / CHECKPOINTS_DIR / layout.LATEST} and model states files)",
                            "pass a checkpoint folder, a tag folder, a run directory, 'auto' or null"))


def no_checkpoint_reason(run_dir: Path) -> tuple[str, str]:
    """Why the run directory ``run_dir`` holds no checkpoint, from its own records (``resolved.yaml``'s
    ``train.save_interval``, ``metrics.json``'s last step), and how to get one: ``(message, hint)``."""
    import json

    from omegaconf import OmegaConf

    from dsrun.rundir import METRICS_JSON, RESOLVED_YAML

    rerun = f"dsrun train --from {run_dir}"
    try:
        interval = int(OmegaConf.select(OmegaConf.load(run_dir / RESOLVED_YAML), "train.save_interval") or 0)
    except (OSError, ValueError, TypeError):
        interval = None
    if interval == 0:
        return (f"{run_dir} has no checkpoint: it trained with train.save_interval=0",
                f"train it again with checkpoints: {rerun} train.save_interval=N")
    try:
        metrics = json.loads((run_dir / METRICS_JSON).read_text())
        last = int(metrics.get("resumed_from_step") or 0) + int(metrics.get("steps") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        last = None
    first = f" at {interval}" if interval else ""
    if last is None:
        return (f"{run_dir} has no checkpoint: it ended before its first save{first} and wrote no "
                f"{METRICS_JSON} (it failed or was stopped: see its dsrun.log)", f"train it again: {rerun}")
    if interval is not None and last < interval:
        return (f"{run_dir} has no checkpoint: it stopped at step {last} before its first save{first}",
                f"train it again, which saves at its last step: {rerun}")
    return (f"{run_dir} has no checkpoint: {run_dir / CHECKPOINTS_DIR / layout.LATEST} is missing",
            f"pass one tag's folder ({run_dir / CHECKPOINTS_DIR}/global_step<N>), or train it again: {rerun}")


class _Engine(Protocol):
    """What the checkpoint hooks use of the engine (``DeepSpeedEngine`` or ``PipelineEngine``)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def global_steps(self) -> int: ...

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str | None, dict[str, Any] | None]: ...

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> bool: ...


class _Stateful(Protocol):
    """The data loader, whose position a checkpoint keeps."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingCheckpoints:
    """The worker's checkpoint hooks, bound to one engine and its data loader."""

    def __init__(self, engine: _Engine, loader: _Stateful, run_dir: Path, save_interval: int, resume: str | None,
                 keep_last: int, last_step: int | None = None, restart_from: Path | None = None):
        self.engine, self.loader, self.last_step = engine, loader, last_step
        self.save_dir = run_dir / CHECKPOINTS_DIR
        self.save_interval, self.keep_last = int(save_interval or 0), int(keep_last or 0)
        # a run directory is fresh for every run, so checkpoints already in it were saved by this run: its ranks
        # were restarted (an elastic membership change, a restart after a failure) and go on from the newest
        # one, whatever train.resume named for the first start. An engine that restarts the ranks itself and
        # keeps its own record of the run's checkpoints (Ray Train: dsrun.ray) names the tag folder
        # (``restart_from``), which wins
        own = (self.save_dir, None) if layout.read_latest(self.save_dir) else None
        restart = (restart_from.parent, restart_from.name) if restart_from is not None else None
        self.resume_from = restart or own or find_checkpoint(resume, run_dir)
        self.last_saved_step: int | None = None

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; returns the optimizer step training continues after."""
        if self.resume_from is None:
            return 0
        load_dir, tag = self.resume_from
        path, client_state = self.engine.load_checkpoint(str(load_dir), tag=tag)
        if path is None:
            return 0
        if client_state and LOADER_KEY in client_state:
            self.loader.load_state_dict(client_state[LOADER_KEY])
        self.last_saved_step = self.engine.global_steps
        if self.engine.global_rank == 0:
            print(f"[dsrun] resumed from {path} at step {self.engine.global_steps}", flush=True)
        return self.engine.global_steps

    def saved_at(self, step: int) -> Path | None:
        """The tag folder of the checkpoint saved after ``step`` (None when none was)."""
        if self.last_saved_step != step:
            return None
        tag = layout.read_latest(self.save_dir)
        return self.save_dir / tag if tag else None

    def save_if_due(self, step: int, force: bool = False, always: bool = False) -> bool:
        """Save after ``step`` when it is a multiple of ``save_interval`` or the run's last step (or ``force``,
        e.g. on Ctrl-C), when saving is on at all, or ``always`` (a preemption: the run must be resumable), and
        not twice at one step; then delete checkpoints beyond the newest ``keep_last``."""
        due = always or bool(self.save_interval) and (force or step % self.save_interval == 0
                                                      or step == self.last_step)
        if not due or step == self.last_saved_step:
            return False
        self.engine.save_checkpoint(str(self.save_dir), client_state={LOADER_KEY: self.loader.state_dict()})
        self.last_saved_step = step
        self._prune()
        return True

    def _prune(self) -> None:
        if self.keep_last and self.engine.global_rank == 0:
            keep = layout.read_latest(self.save_dir)
            tags = [t for t in layout.list_tags(self.save_dir) if t != keep]
            # the newest keep_last - 1 others survive next to the one `latest` names
            for tag in tags[: max(0, len(tags) - (self.keep_last - 1))]:
                atomic.remove_tree(self.save_dir / tag)
        comm.barrier()
