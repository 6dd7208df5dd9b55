"""Where glibc puts ZeRO-3's big host temporaries: fresh mappings or its heap.

ZeRO-3 allocates and frees a full buffer per parameter on every gather. glibc serves big requests with
``mmap`` (returned on free) but raises that threshold to the size of each freed block, after which the
same requests come from the heap, where freed pages stay resident: a rank's peak RSS then grows with
whatever sizes it happened to free. :func:`fix_mmap_threshold` pins the threshold (which stops the
adjustment) and :func:`trim` returns free heap pages now. Both are no-ops off glibc, and the pin is left
alone where the environment sets glibc's own ``MALLOC_MMAP_THRESHOLD_`` (the user's, or a measured run's
``dsrun estimate-memory --measure``).

A mapping costs a page fault per 4 KiB each time it is first written: a pin below the temporaries of every
module (its gathered parameters, gloo's flat copy of an all-gather's output and of a reduce-scatter's
input, autograd's full weight gradients) makes each of them fault in afresh, the system time that made
ZeRO-3 slower than FSDP2 on the CPU (docs/performance.md). The stage-3 strategy pins the threshold just
above the largest of them (:func:`threshold_above` of one module's gathered bytes): they come from the heap,
reused step after step, and only larger buffers (a whole bucket past its size) are mapped.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20
MAX_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): mallopt refuses more


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def threshold_above(nbytes: int) -> int:
    """The smallest power of two above ``nbytes``, within ``[MMAP_THRESHOLD_BYTES, MAX_MMAP_THRESHOLD_BYTES]``."""
    return min(MAX_MMAP_THRESHOLD_BYTES, max(MMAP_THRESHOLD_BYTES, 1 << int(nbytes).bit_length()))


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of ``nbytes`` or more with its own mapping, returned to the OS when freed (not
    where the environment sets ``MALLOC_MMAP_THRESHOLD_``: that choice stands)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    return bool(_LIBC is not None and _LIBC.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def trim() -> bool:
    """Return free heap pages to the OS now."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))
