"""The memory-mapped indexed file the data analyzer writes and the data sampler reads.

The layout is Megatron's and DeepSpeed's ``MMapIndexedDataset``, so index files made by DeepSpeed's analyzer
load here and the other way round. ``PREFIX.bin`` holds the items' elements back to back; ``PREFIX.idx`` holds
the magic ``b"MMIDIDX\\x00\\x00"``, the version (``<Q`` 1), the dtype code (``<B``), the item count and the
document count (``<Q`` each), then the item sizes (int32), their byte offsets into ``.bin`` (int64) and the
document index (int64). An item is a 1-D array; ``dataset[i]`` is a read-only view of it.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable, Union

import numpy as np
import numpy.typing as npt
import torch

IndexDType = Union[npt.DTypeLike, torch.dtype]  # a numpy or torch integer dtype (numpy_dtype checks it)
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint16,
                           7: np.uint32, 8: np.uint64}
_TORCH = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64}


def numpy_dtype(dtype: IndexDType) -> type:
    """The numpy integer type for ``dtype`` (numpy or torch); only the eight index dtypes are allowed."""
    resolved = _TORCH.get(dtype, dtype)
    resolved = np.dtype(resolved).type
    if resolved not in DTYPES.values():
        raise ValueError(f"index dtype {dtype} is not supported; allowed: "
                         + ", ".join(np.dtype(t).name for t in DTYPES.values()))
    return resolved


def dtype_code(dtype: IndexDType) -> int:
    resolved = numpy_dtype(dtype)
    return next(code for code, t in DTYPES.items() if t is resolved)


def find_fit_int_dtype(min_value: int, max_value: int) -> type:
    """The smallest integer type holding ``[min_value, max_value]``: unsigned when ``min_value >= 0``."""
    if min_value >= 0:
        for kind in (np.uint8, np.uint16, np.uint32):
            if max_value <= np.iinfo(kind).max:
                return kind
        return np.uint64
    for kind in (np.int8, np.int16, np.int32):
        if np.iinfo(kind).min <= min_value and max_value <= np.iinfo(kind).max:
            return kind
    return np.int64


def index_file_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.idx"


def data_file_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.bin"


class MMapIndexedDatasetBuilder:
    """Writes ``.bin`` as items arrive; :meth:`finalize` writes ``.idx``."""

    def __init__(self, out_file: str | os.PathLike, dtype: IndexDType = np.int64):
        self._dtype = numpy_dtype(dtype)
        self._data_file = open(out_file, "wb")
        self._sizes: list[int] = []
        self._doc_idx = [0]

    def add_item(self, tensor: torch.Tensor | np.ndarray) -> None:
        array = tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
        self.add_item_numpy(array)

    def add_item_numpy(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=self._dtype).reshape(-1)
        self._data_file.write(array.tobytes(order="C"))
        self._sizes.append(int(array.size))

    def add_items(self, arrays: Iterable[np.ndarray]) -> None:
        for array in arrays:
            self.add_item_numpy(array)

    def add_concatenated(self, values: np.ndarray, sizes: np.ndarray) -> None:
        """Many items at once: ``values`` holds them back to back, ``sizes`` their lengths."""
        self._data_file.write(np.ascontiguousarray(values, dtype=self._dtype).tobytes(order="C"))
        self._sizes.extend(int(s) for s in sizes)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file: str | os.PathLike) -> None:
        self._data_file.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(self._dtype).itemsize, out=pointers[1:])
        with open(index_file, "wb") as out:
            out.write(MAGIC)
            out.write(struct.pack("<Q", VERSION))
            out.write(struct.pack("<B", dtype_code(self._dtype)))
            out.write(struct.pack("<Q", len(sizes)))
            out.write(struct.pack("<Q", len(self._doc_idx)))
            out.write(sizes.tobytes(order="C"))
            out.write(pointers.tobytes(order="C"))
            out.write(np.asarray(self._doc_idx, dtype=np.int64).tobytes(order="C"))


def create_mmap_dataset_builder(fname: str | os.PathLike, dtype: IndexDType) -> MMapIndexedDatasetBuilder:
    return MMapIndexedDatasetBuilder(data_file_path(fname), dtype=dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, fname: str | os.PathLike) -> None:
    builder.end_document()
    builder.finalize(index_file_path(fname))


def write_items(fname: str | os.PathLike, dtype: IndexDType, values: np.ndarray, sizes: np.ndarray) -> None:
    """One indexed file of ``len(sizes)`` items whose elements are ``values`` back to back."""
    builder = create_mmap_dataset_builder(fname, dtype)
    builder.add_concatenated(values, sizes)
    close_mmap_dataset_builder(builder, fname)


class MMapIndexedDataset:
    """Read-only items of an indexed file; ``path`` is the prefix (without ``.idx``/``.bin``)."""

    def __init__(self, path: str | os.PathLike, skip_warmup: bool = True):
        self.path = str(path)
        with open(index_file_path(path), "rb") as stream:
            if stream.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{index_file_path(path)} is not an MMapIndexedDataset index file")
            (version,) = struct.unpack("<Q", stream.read(8))
            if version != VERSION:
                raise ValueError(f"{index_file_path(path)}: unsupported index version {version}")
            (code,) = struct.unpack("<B", stream.read(1))
            (length,) = struct.unpack("<Q", stream.read(8))
            (doc_count,) = struct.unpack("<Q", stream.read(8))
            offset = stream.tell()
        self._dtype = DTYPES[code]
        index = np.memmap(index_file_path(path), mode="r", order="C")
        self._sizes = np.frombuffer(index, dtype=np.int32, count=length, offset=offset)
        self._pointers = np.frombuffer(index, dtype=np.int64, count=length, offset=offset + self._sizes.nbytes)
        self._doc_idx = np.frombuffer(index, dtype=np.int64, count=doc_count,
                                      offset=offset + self._sizes.nbytes + self._pointers.nbytes)
        data_size = os.path.getsize(data_file_path(path))
        self._data = (np.memmap(data_file_path(path), mode="r", order="C") if data_size
                      else np.zeros(0, dtype=np.uint8))

    @property
    def dtype(self) -> type:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    def __len__(self) -> int:
        return len(self._sizes)

    def _item(self, i: int) -> np.ndarray:
        return np.frombuffer(self._data, dtype=self._dtype, count=int(self._sizes[i]), offset=int(self._pointers[i]))

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            return [self._item(i) for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"item {idx} out of range for {len(self)} items of {self.path}")
        return self._item(idx)

    def all_elements(self) -> np.ndarray:
        """Every item's elements back to back (a view of ``.bin``)."""
        total = int(self._sizes.sum(dtype=np.int64))
        return np.frombuffer(self._data, dtype=self._dtype, count=total) if total else np.zeros(0, self._dtype)

    @staticmethod
    def exists(path: str | os.PathLike) -> bool:
        return Path(index_file_path(path)).is_file() and Path(data_file_path(path)).is_file()
