"""Durable file writes: a file is written under a temporary name, fsynced, and renamed, and the folder is
fsynced, so after a crash a name either holds the complete new content or the old one.

Tests simulate a crash at named points of a save: with ``DSRUN_TEST_CRASH_AT=<point>`` (and optionally
``DSRUN_TEST_CRASH_RANK=<rank>``) the process SIGKILLs itself when it reaches ``crash_point(<point>)``.
Nothing happens when the variable is unset.

Every file :func:`save_torch` writes goes through :func:`dsrun.io.open_writer`: within :func:`writing_with`
(``engine_io.save_staged`` enters it with the ``checkpoint.writer`` section's settings) the writer it names
(DeepSpeed's fast O_DIRECT writer, its Python writer or its mock), else a plain file; either way fsynced.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
from pathlib import Path
import types
from typing import Iterator

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


_counting: list[_ByteCounter] = []  # while counting_bytes() runs: save_torch counts into the last one


@contextlib.contextmanager
def counting_bytes() -> Iterator[_ByteCounter]:
    """Within it :func:`save_torch` writes nothing and adds each file's size to the counter yielded: how many
    bytes a save that did not fit needs."""
    _counting.append(_ByteCounter())
    try:
        yield _counting[-1]
    finally:
        _counting.pop()

_writers: list[WriterSettings | None] = []  # while writing_with() runs: save_torch writes through the last one


@contextlib.contextmanager
def writing_with(settings: WriterSettings | None) -> Iterator[None]:
    """Within it :func:`save_torch` writes each file through the writer ``settings`` name (None: a plain file).
    Process-wide, not per thread: a thread that writes files later captures :func:`writer_in_effect` and
    enters this again."""
    _writers.append(settings)
    try:
        yield
    finally:
        _writers.pop()


def writer_in_effect() -> WriterSettings | None:
    return _writers[-1] if _writers else None


_legacy_format: list[bool] = []  # while legacy_serialization() runs: save_torch writes torch's pre-1.6 format


@contextlib.contextmanager
def legacy_serialization(enabled: bool = True) -> Iterator[None]:
    """Within it (when ``enabled``) :func:`save_torch` writes torch's legacy (non-zipfile) format:
    ``checkpoint.checkpoint_serialization: false``, DeepSpeed's ``_use_new_zipfile_serialization=False``."""
    _legacy_format.append(enabled)
    try:
        yield
    finally:
        _legacy_format.pop()


# The points of a save where tests kill a rank (in order); see dsrun.checkpoint.engine_io.save_checkpoint.
CRASH_POINTS = ("staging_created", "model_states_torn", "after_model_states", "after_optim_states",
                "before_commit", "old_tag_moved_aside", "after_commit", "latest_tmp_written", "after_latest")


def crash_point(name: str, rank: int) -> None:
    """SIGKILL this process if a test asked for a crash at ``name`` (on ``rank``, or any rank)."""
    if os.environ.get(CRASH_ENV) != name:
        return
    wanted = os.environ.get(CRASH_RANK_ENV)
    if wanted is not None and int(wanted) != rank:
        return
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
    if _legacy_format and _legacy_format[-1]:
        extra["_use_new_zipfile_serialization"] = False
    if _counting:
        torch.save(obj, _counting[-1], **extra)
        return
    tmp = _tmp_name(path)
    try:
        with open_writer(tmp, writer_in_effect()) as fh:  # closing it makes the file durable (fsync)
            torch.save(obj, fh, **extra)
        if torn_point is not None and os.environ.get(CRASH_ENV) == torn_point:
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
