"""Where glibc puts ZeRO-3's big host temporaries: fresh mappings or its heap.

ZeRO-3 allocates and frees a full buffer per parameter on every gather. glibc serves big requests with
``mmap`` (returned on free) but raises that threshold to the size of each freed block, after which the
same requests come from the heap, where freed pages stay resident: a rank's peak RSS then grows with
whatever sizes it happened to free. :func:`fix_mmap_threshold` pins the threshold (which stops the
adjustment) and :func:`trim` returns free heap pages now. Both are no-ops off glibc, and the pin is left
alone where the environment sets glibc's own ``MALLOC_MMAP_THRESHOLD_`` (the user's, or a measured run's
``dsrun estimate-memory --measure``).

A mapping costs a page fault per 4 KiB each time it is first written, so the stage-3 strategy on the CPU could pin
the threshold above one module's temporaries (its gathered parameters, gloo's flat copies, autograd's full
weight gradients) and serve them from the heap: 14-16% faster steps on the 100M GPT, but their freed pages
stayed resident, about a whole gathered model per rank under the step's peak (+25-36% peak RSS, and the peak
stopped falling as 1/N with the ranks). The strategy pins 1 MiB (:data:`MMAP_THRESHOLD_BYTES`): memory first
(docs/performance.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
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
    """Serve every allocation of ``nbytes`` or more with its own mapping, returned to the OS when freed (not
    where the environment sets ``MALLOC_MMAP_THRESHOLD_``: that choice stands)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    return bool(_LIBC is not None and _LIBC.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def trim() -> bool:
    """Return free heap pages to the OS now."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))
