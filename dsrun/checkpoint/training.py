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

Every save is recorded (:class:`SaveRecord`: the step, how long training waited for it, how long it took to be
written and published, its bytes). With ``checkpoint.writer.decoupled`` a save returns once the state is in host
memory (:mod:`.decoupled`); a save at a stop (Ctrl-C, a preemption) and the run's end wait for the write in
flight to be published.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dsrun import comm
from dsrun.utils.errors import Problem, UserError

from . import atomic, decoupled, layout

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


@dataclass
class SaveRecord:
    """One save of the run (``metrics.json``'s ``checkpoint_saves``): the step, the global samples there (the
    monitors' x axis), ``blocking_s`` (how long training waited: the whole save with the deletion of old ones, or
    a decoupled save's snapshot and any wait for the write before it), ``write_s`` (until the checkpoint was
    published: a synchronous save's ``engine.save_checkpoint`` call; a decoupled save's background write and
    commit, from its snapshot on) and ``bytes`` (the published tag folder, every rank's files; known on rank 0)."""

    step: int
    samples: int
    blocking_s: float
    write_s: float | None = None
    bytes: int | None = None
    job: decoupled.SaveJob | None = field(default=None, repr=False)

    def settled(self) -> bool:
        """Published (or failed): ``write_s`` and ``bytes`` are known."""
        if self.job is not None and self.job.done.is_set():
            self.write_s, self.bytes, self.job = self.job.write_s, self.job.bytes, None
        return self.job is None

    def as_metrics(self) -> dict[str, Any]:
        return {"step": self.step, "blocking_s": self.blocking_s, "write_s": self.write_s, "bytes": self.bytes}

    def events(self) -> list[tuple[str, float, int]]:
        """The record for the monitors (CSV, TensorBoard, MLflow ...), at the saved step's samples."""
        values = {"blocking_s": self.blocking_s, "write_s": self.write_s, "bytes": self.bytes}
        return [(f"Checkpoint/Samples/{name}", float(value), self.samples) for name, value in values.items()
                if value is not None]


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
        self.records: list[SaveRecord] = []
        # checkpoint.writer.decoupled: saves return after the snapshot (an engine without a DeepSpeed config: no)
        self.decoupled = decoupled.enabled(getattr(getattr(engine, "_config", None), "checkpoint", None))

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
        not twice at one step; then delete checkpoints beyond the newest ``keep_last``. A save at a stop
        (``force``, ``always``) is never skipped for a decoupled write in flight, and returns once it is
        published. False when nothing was saved."""
        due = always or bool(self.save_interval) and (force or step % self.save_interval == 0
                                                      or step == self.last_step)
        if not due or step == self.last_saved_step:
            return False
        started = time.perf_counter()  # training waits from here to the return: blocking_s
        stopping, writer = force or always, decoupled.active() if self.decoupled else None
        if stopping and writer is not None:
            writer.wait()  # however long the write in flight takes (the grace period bounds a preemption)
        if self.decoupled:  # make room now: the write publishes on its own thread
            self._prune(room_for_one=True)
        before = writer.job if writer is not None else None
        called = time.perf_counter()
        saved = self.engine.save_checkpoint(str(self.save_dir), client_state={LOADER_KEY: self.loader.state_dict()})
        if saved is False:  # skipped: a decoupled write still in flight (the engine said so)
            return False
        writer = decoupled.active() if self.decoupled else None
        job = writer.job if writer is not None and writer.job is not before else None
        record = SaveRecord(step, self.engine.global_samples, 0.0, job=job)
        if job is None:  # synchronous: written and published within the call
            record.write_s = time.perf_counter() - called
            tag = layout.read_latest(self.save_dir) if self.engine.global_rank == 0 else None
            record.bytes = decoupled.folder_bytes(self.save_dir / tag) if tag else None
            self._prune()
        elif stopping:
            self.wait_for_writes()
        record.blocking_s = time.perf_counter() - started
        self.records.append(record)
        self.last_saved_step = step
        return True

    def wait_for_writes(self) -> None:
        """Collective: the decoupled write in flight (if any) is durable and published (its error raised here);
        then checkpoints beyond ``keep_last`` go."""
        decoupled.drain()
        for record in self.records:
            record.settled()
        self._prune()

    def _prune(self, room_for_one: bool = False) -> None:
        """Collective: rank 0 deletes all but the newest ``keep_last`` (the one ``latest`` names always survives);
        ``room_for_one``: before a decoupled save, which counts as one of them once it is published. Nothing is
        deleted while a decoupled write runs: its thread renames folders and rewrites ``latest``."""
        writer = decoupled.active()
        if self.keep_last and self.engine.global_rank == 0 and not (writer is not None and writer.busy()):
            keep = layout.read_latest(self.save_dir)
            tags = [t for t in layout.list_tags(self.save_dir) if t != keep]
            others = max(0, self.keep_last - 1 - (1 if room_for_one else 0))
            # the newest `others` survive next to the one `latest` names
            for tag in tags[: max(0, len(tags) - others)]:
                atomic.remove_tree(self.save_dir / tag)
        comm.barrier()
