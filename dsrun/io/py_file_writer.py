"""DeepSpeed's ``PyFileWriter``: a plain buffered Python file, with write statistics."""
from __future__ import annotations

import os
import time

from .base_file_writer import BaseFileWriter
from .constants import CLOSE_COUNT_KEY, FILENO_COUNT_KEY, FLUSH_COUNT_KEY, INVALID_FD, WRITE_BYTES_KEY, \
    WRITE_COUNT_KEY, WRITE_SEC_KEY


class PyFileWriter(BaseFileWriter):
    """``open(file_path, "wb")``; ``close()`` closes it (it does not fsync: :func:`dsrun.io.open_writer` does)."""

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

    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        start = time.perf_counter()
        self._fp.write(buffer)
        self._incr_stats(WRITE_SEC_KEY, time.perf_counter() - start)
        self._incr_stats(WRITE_COUNT_KEY)
        n = memoryview(buffer).nbytes
        self._incr_stats(WRITE_BYTES_KEY, n)
        return n
