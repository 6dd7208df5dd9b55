"""DeepSpeed's ``BaseFileWriter``: a write-only file object ``torch.save`` can write to, counting what it does."""
from __future__ import annotations

import os
from typing import Union

from dsrun.utils.logging import logger

from .constants import (CLOSE_COUNT_KEY, FILE_PATH_KEY, FILENO_COUNT_KEY, FLUSH_COUNT_KEY, INVALID_FD,
                        WRITE_BYTES_KEY, WRITE_COUNT_KEY, WRITE_SEC_KEY, WRITE_SPEED_KEY)

BASE_STAT_KEYS = [CLOSE_COUNT_KEY, FILENO_COUNT_KEY, FLUSH_COUNT_KEY, WRITE_COUNT_KEY, WRITE_BYTES_KEY,
                  WRITE_SEC_KEY, WRITE_SPEED_KEY]
Stat = Union[int, float, str]


class BaseFileWriter:
    """``write``/``flush``/``close``/``fileno`` and a statistics dict (``_stats``, printed by ``_dump_state``).

    ``fileno()`` returns ``INVALID_FD`` (-1) as DeepSpeed's writers do: code that would write around the object
    through a descriptor (torch's legacy serializer) sees none and calls ``write``.
    """

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        self._file_path = os.fspath(file_path)
        self._stats: dict[str, Stat] = {k: 0 for k in BASE_STAT_KEYS}

    def close(self) -> None:
        pass

    def fileno(self) -> int:
        return INVALID_FD

    def flush(self) -> None:
        pass

    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        return 0

    def writable(self) -> bool:
        return True

    def file_path(self) -> str:
        return self._file_path

    def statistics(self) -> dict[str, Stat]:
        """The counters so far, with the derived speeds (a copy)."""
        self._derive_speeds()
        return {**self._stats, FILE_PATH_KEY: self.file_path()}

    def _incr_stats(self, key: str, incr: int | float = 1) -> None:
        self._stats[key] = self._stats.get(key, 0) + incr  # type: ignore[operator]

    def _derive_speeds(self) -> None:
        if self._stats[WRITE_SEC_KEY] > 0:  # type: ignore[operator]
            self._stats[WRITE_SPEED_KEY] = self._stats[WRITE_BYTES_KEY] / self._stats[WRITE_SEC_KEY] / 1024 ** 3  # type: ignore[operator]

    def _dump_state(self) -> None:
        """Log the statistics on one line (DeepSpeed prints ``stats = {...}``)."""
        logger.info("stats = %s", self.statistics())


class OpenFileWriter(BaseFileWriter):
    """A writer over ``open(file_path, "wb")`` with counted ``close``/``flush`` and no descriptor handed out: what
    ``PyFileWriter`` and ``MockFileWriter`` share (``close()`` does not fsync: :func:`dsrun.io.open_writer` does)."""

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        super().__init__(file_path)
        self._fp = open(self._file_path, "wb")

    def close(self) -> None:
        self._incr_stats(CLOSE_COUNT_KEY)
        self._fp.close()

    def fileno(self) -> int:
        self._incr_stats(FILENO_COUNT_KEY)
        return INVALID_FD

    def flush(self) -> None:
        self._incr_stats(FLUSH_COUNT_KEY)
        self._fp.flush()
