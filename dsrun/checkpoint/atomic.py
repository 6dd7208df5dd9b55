"""Durable file writes: a file is written under a temporary name, fsynced, and renamed, and the folder is
fsynced, so after a crash a name either holds the complete new content or the old one.

Tests simulate a crash at named points of a save: with ``DSRUN_TEST_CRASH_AT=<point>`` (and optionally
``DSRUN_TEST_CRASH_RANK=<rank>``) the process SIGKILLs itself when it reaches ``crash_point(<point>)``.
Nothing happens when the variable is unset.

Every file :func:`save_torch` writes goes through :func:`dsrun.io.open_writer`: within :func:`writing_with`
(``engine_io.save_staged`` enters it with the ``checkpoint.writer`` section's settings) the writer it names
(DeepSpeed's fast O_DIRECT writer, its Python writer or its mock), else a plain file; either way fsynced.

Modes change what :func:`save_torch` does on the calling thread (all thread-local: a decoupled save's writer
thread writes while the training thread may snapshot the next): :func:`counting_bytes` (count the bytes a
save needs, write nothing), :func:`capturing_writes` (a decoupled save's snapshot: record each file as a
:class:`PendingFile` holding a host copy of its object and the writer and format in effect, write nothing;
:mod:`.decoupled` writes them later under the same two), :func:`writing_with` and
:func:`legacy_serialization`.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from dsrun.io import WriterSettings, open_writer

CRASH_ENV, CRASH_RANK_ENV = "DSRUN_TEST_CRASH_AT", "DSRUN_TEST_CRASH_RANK"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a full disk or quota (torch's zip writer reports it as a RuntimeError whose
    context is the OSError)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class _ByteCounter:
    """A write-only sink that counts what ``torch.save`` writes (the size a file needs, without a disk)."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.bytes += len(data)
        return len(data)

    def flush(self) -> None:
        pass


class _Modes(threading.local):
    """Per thread (a decoupled save's writer thread writes while the training thread may snapshot the next):
    the counters of :func:`counting_bytes`, the lists of :func:`capturing_writes`, the writers of
    :func:`writing_with` and the flags of :func:`legacy_serialization` in effect."""

    def __init__(self) -> None:
        self.counting: list[_ByteCounter] = []
        self.capturing: list[tuple[list[PendingFile], Callable[[object], object]]] = []
        self.writers: list[WriterSettings | None] = []  # writing_with(): save_torch writes through the last one
        self.legacy: list[bool] = []  # legacy_serialization(): save_torch writes torch's pre-1.6 format


_modes = _Modes()


@dataclass
class PendingFile:
    """One file of a decoupled save, captured by :func:`capturing_writes`: the object (its tensors copied to
    host memory), where it goes and how :func:`save_torch` was asked to write it."""

    obj: object
    path: Path
    rank: int
    torn_point: str | None
    pickle_module: types.ModuleType | types.SimpleNamespace | None
    writer: WriterSettings | None = None  # the checkpoint.writer settings of the save (None: a plain file)
    legacy: bool = False  # checkpoint_serialization false: torch's legacy format


@contextlib.contextmanager
def counting_bytes() -> Iterator[_ByteCounter]:
    """Within it :func:`save_torch` writes nothing and adds each file's size to the counter yielded: how many
    bytes a save that did not fit needs."""
    _modes.counting.append(_ByteCounter())
    try:
        yield _modes.counting[-1]
    finally:
        _modes.counting.pop()


@contextlib.contextmanager
def capturing_writes(snapshot: Callable[[object], object]) -> Iterator[list[PendingFile]]:
    """Within it (on this thread) :func:`save_torch` writes nothing: it appends a :class:`PendingFile` holding
    ``snapshot(obj)`` (a copy the caller's next in-place updates cannot reach) to the list yielded."""
    _modes.capturing.append(([], snapshot))
    try:
        yield _modes.capturing[-1][0]
    finally:
        _modes.capturing.pop()


@contextlib.contextmanager
def writing_with(settings: WriterSettings | None) -> Iterator[None]:
    """Within it (on this thread) :func:`save_torch` writes each file through the writer ``settings`` name (None:
    a plain file); a decoupled save's captured files carry it to the writer thread."""
    _modes.writers.append(settings)
    try:
        yield
    finally:
        _modes.writers.pop()


def writer_in_effect() -> WriterSettings | None:
    return _modes.writers[-1] if _modes.writers else None


@contextlib.contextmanager
def legacy_serialization(enabled: bool = True) -> Iterator[None]:
    """Within it (on this thread, when ``enabled``) :func:`save_torch` writes torch's legacy (non-zipfile) format:
    ``checkpoint.checkpoint_serialization: false``, DeepSpeed's ``_use_new_zipfile_serialization=False``."""
    _modes.legacy.append(enabled)
    try:
        yield
    finally:
        _modes.legacy.pop()


# The points of a save where tests kill a rank (in order); see dsrun.checkpoint.engine_io.save_checkpoint.
CRASH_POINTS = ("staging_created", "model_states_torn", "after_model_states", "after_optim_states",
                "before_commit", "old_tag_moved_aside", "after_commit", "latest_tmp_written", "after_latest")
# The points of a decoupled save's background write (dsrun.checkpoint.decoupled), in order, all on the writer
# thread while training goes on: nothing written yet; a half-written temporary file; every file of this rank
# durable, before the ranks agree. The commit then passes the points above from "before_commit" on.
DECOUPLED_CRASH_POINTS = ("decoupled_write_started", "decoupled_file_torn", "decoupled_files_durable")


def crash_armed(name: str, rank: int) -> bool:
    """Whether a test asked for a crash at ``name`` on ``rank`` (or on any rank)."""
    if os.environ.get(CRASH_ENV) != name:
        return False
    wanted = os.environ.get(CRASH_RANK_ENV)
    return wanted is None or int(wanted) == rank


def crash_point(name: str, rank: int) -> None:
    """SIGKILL this process if a test asked for a crash at ``name`` (on ``rank``, or any rank)."""
    if crash_armed(name, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def save_torch(obj: object, path: Path, rank: int = 0, torn_point: str | None = None,
               pickle_module: types.ModuleType | types.SimpleNamespace | None = None) -> None:
    """``torch.save`` of any picklable ``obj`` to ``path``, atomically and durably. ``torn_point``: a crash point
    at which a test leaves a half-written temporary file behind. ``pickle_module``: torch.save's (default: pickle)."""
    extra: dict[str, object] = {} if pickle_module is None else {"pickle_module": pickle_module}
    if _modes.legacy and _modes.legacy[-1]:
        extra["_use_new_zipfile_serialization"] = False
    if _modes.counting:
        torch.save(obj, _modes.counting[-1], **extra)
        return
    if _modes.capturing:
        pending, snapshot = _modes.capturing[-1]
        pending.append(PendingFile(snapshot(obj), path, rank, torn_point, pickle_module, writer_in_effect(),
                                   bool(_modes.legacy and _modes.legacy[-1])))
        return
    tmp = _tmp_name(path)
    try:
        with open_writer(tmp, writer_in_effect()) as fh:  # closing it makes the file durable (fsync)
            fh.save(obj, **extra)
        if torn_point is not None and crash_armed(torn_point, rank):
            os.truncate(tmp, max(1, tmp.stat().st_size // 2))
            crash_point(torn_point, rank)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a partial file (e.g. on a full disk) only takes the space others need
        raise
    os.replace(tmp, path)


def write_text(path: Path, text: str, rank: int = 0, crash_before_rename: str | None = None) -> None:
    tmp = _tmp_name(path)
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    if crash_before_rename:
        crash_point(crash_before_rename, rank)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def copy_file(src: Path, dst: Path) -> None:
    tmp = _tmp_name(dst)
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, dst)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
