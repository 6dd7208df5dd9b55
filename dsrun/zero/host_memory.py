"""Making freed host memory really go back to the OS (glibc), so ZeRO-3 on CPU holds only its shards.

ZeRO-3 allocates and frees a full buffer per parameter on every gather. glibc serves big requests with
``mmap`` (returned on free) but raises that threshold to the size of each freed block, after which the
same requests come from the heap, where freed pages stay resident: a rank's peak RSS then approaches the
whole model even though it never holds it. :func:`fix_mmap_threshold` pins the threshold (which stops
the adjustment) and :func:`trim` returns free heap pages now. Both are no-ops off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of ``nbytes`` or more with its own mapping, returned to the OS when freed."""
    return bool(_LIBC is not None and _LIBC.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def trim() -> bool:
    """Return free heap pages to the OS now."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))
