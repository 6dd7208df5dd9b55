"""DeepSpeed's ``PyFileWriter``: a plain buffered Python file, with write statistics."""
from __future__ import annotations

import time

from .base_file_writer import OpenFileWriter
from .constants import WRITE_BYTES_KEY, WRITE_COUNT_KEY, WRITE_SEC_KEY


class PyFileWriter(OpenFileWriter):
    """``open(file_path, "wb")``; ``close()`` closes it (it does not fsync: :func:`dsrun.io.open_writer` does)."""

    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        start = time.perf_counter()
        self._fp.write(buffer)
        self._incr_stats(WRITE_SEC_KEY, time.perf_counter() - start)
        self._incr_stats(WRITE_COUNT_KEY)
        n = memoryview(buffer).nbytes
        self._incr_stats(WRITE_BYTES_KEY, n)
        return n
