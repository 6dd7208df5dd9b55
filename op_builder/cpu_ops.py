"""Builders for the CPU optimizer ops and the async I/O op."""
from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

from op_builder.builder import OpBuilder


class CPUAdamBuilder(OpBuilder):
    NAME = "cpu_adam"
    SOURCES = ("adam/cpu_adam.cpp",)


class CPUAdagradBuilder(OpBuilder):
    NAME = "cpu_adagrad"
    SOURCES = ("adagrad/cpu_adagrad.cpp",)


class CPULionBuilder(OpBuilder):
    NAME = "cpu_lion"
    SOURCES = ("lion/cpu_lion.cpp",)


class HostCacheBuilder(OpBuilder):
    """The capped cache of large host blocks in front of torch's CPU allocator (:mod:`dsrun.zero.host_memory`)."""

    NAME = "host_cache"
    SOURCES = ("host_cache/host_cache.cpp",)
    INCLUDES = ()


def libaio_available() -> bool:
    """Whether libaio's header and library are installed (Debian/Ubuntu: ``apt install libaio-dev``)."""
    include_dirs = ["/usr/include", "/usr/local/include",
                    *filter(None, os.environ.get("CPATH", "").split(os.pathsep)),
                    *filter(None, os.environ.get("C_INCLUDE_PATH", "").split(os.pathsep))]
    header = any((Path(d) / "libaio.h").is_file() for d in include_dirs)
    return header and ctypes.util.find_library("aio") is not None


class AsyncIOBuilder(OpBuilder):
    """Async file I/O for NVMe offload. Uses libaio when installed, else a pool of pread/pwrite threads."""

    NAME = "async_io"
    SOURCES = ("aio/dsrun_aio.cpp",)
    INCLUDES = ()  # self-contained: editing the optimizer headers must not invalidate this op's cache

    def _with_libaio(self) -> bool:
        return os.environ.get("DSRUN_AIO_NO_LIBAIO") != "1" and libaio_available()

    def cxx_flags(self) -> list[str]:
        return ["-O2", "-std=c++17", *(["-DDSRUN_HAVE_LIBAIO"] if self._with_libaio() else [])]

    def ld_flags(self) -> list[str]:
        return ["-laio"] if self._with_libaio() else []

    def backend(self) -> str:
        return "libaio + threads" if self._with_libaio() else "threads (libaio-dev not found)"
