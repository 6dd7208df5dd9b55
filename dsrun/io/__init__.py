"""DeepSpeed's ``deepspeed.io``: file writers ``torch.save`` writes checkpoints through (FastPersist).

* :class:`PyFileWriter`: a plain buffered file;
* :class:`FastFileWriter` (with :class:`FastFileWriterConfig`): O_DIRECT writes of aligned, double-buffered
  chunks through dsrun's async I/O op (``dsrun.ops.aio``), the unaligned tail through the page cache, fsync;
* :class:`MockFileWriter`: counts the bytes and writes nothing.

``torch.save(obj, writer); writer.close()``. The ``checkpoint.writer`` config section picks the writer every
checkpoint file goes through (:func:`open_writer`, called by ``dsrun.checkpoint.atomic.save_torch``, which saves
with ``CheckpointFile.save``: through the fast writer, torch's CRC32 of every record is computed by the writer
on other threads instead, :mod:`.zip_crc`).
"""
from __future__ import annotations

from .fast_file_writer import FastFileWriter, FastFileWriterConfig
from .factory import CheckpointFile, WriterSettings, open_writer
from .mock_file_writer import MockFileWriter
from .py_file_writer import PyFileWriter

__all__ = ["CheckpointFile", "FastFileWriter", "FastFileWriterConfig", "MockFileWriter", "PyFileWriter",
           "WriterSettings", "open_writer"]
