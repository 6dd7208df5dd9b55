"""DeepSpeed's ``MockFileWriter``: counts what would be written and writes nothing (the file is created empty),
to measure serialization without the disk."""
from __future__ import annotations

import os

from .base_file_writer import OpenFileWriter
from .constants import SAVE_STORAGE_BYTES_KEY, SAVE_STORAGE_KEY, STORAGE_OBJ_SIZE, WRITE_BYTES_KEY, WRITE_COUNT_KEY
from .storage import StorageObject, storage_nbytes


class MockFileWriter(OpenFileWriter):

    def __init__(self, file_path: str | os.PathLike[str]) -> None:
        super().__init__(file_path)
        self._stats[SAVE_STORAGE_KEY] = 0
        self._stats[SAVE_STORAGE_BYTES_KEY] = 0

    def write(self, buffer: bytes | bytearray | memoryview) -> int:
        return self._write(memoryview(buffer).nbytes)

    def save_torch_storage_object_list(self, storage_obj_list: list[StorageObject], save_size: bool) -> int:
        """Count each ``(storage, dtype)`` as written (with its 8-byte size header when ``save_size``)."""
        total = 0
        for obj in storage_obj_list:
            nbytes = storage_nbytes(obj)
            self._incr_stats(SAVE_STORAGE_KEY)
            self._incr_stats(SAVE_STORAGE_BYTES_KEY, nbytes)
            total += (self._write(STORAGE_OBJ_SIZE) if save_size else 0) + self._write(nbytes)
        return total

    def _write(self, num_bytes: int) -> int:
        self._incr_stats(WRITE_COUNT_KEY)
        self._incr_stats(WRITE_BYTES_KEY, num_bytes)
        return num_bytes
