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

The temporaries recur with the same sizes module after module, so :func:`cache_large_blocks` puts a capped cache
in front of torch's CPU allocator (the compiled ``host_cache`` op): a freed block of 1 MiB or more is kept for the
next request of its size while the cache holds at most ``cap_bytes``, so a step re-faults only what the cap cannot
hold, and the peak grows by at most the cap (:func:`host_cache_stats` counts hits and misses).
``DSRUN_HOST_CACHE_MB`` overrides the cap (0: no cache).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

from dsrun.constants import ZERO3_HOST_CACHE_MODULES, zero3_host_cache_cap

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20
# ZeRO-3's host cache cap on the CPU, in modules' gathered bytes: a module's gathered parameters, the collectives'
# flat copies and autograd's full weight gradients (the 100M GPT: faults per step 369k -> 174k at about 6
# modules, 198k at 3, 265k at 1.5; docs/performance.md); in dsrun.constants, which the estimator reads too
HOST_CACHE_MODULES = ZERO3_HOST_CACHE_MODULES


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


def cache_large_blocks(cap_bytes: int) -> bool:
    """Keep freed host blocks of at least :data:`MMAP_THRESHOLD_BYTES`, up to ``cap_bytes`` in all, for the next
    request of the same size (``DSRUN_HOST_CACHE_MB`` overrides the cap; 0 turns the cache off). False when the
    cache is off or the op cannot be built (no C++ compiler: one warning, as every op's fallback)."""
    cap_bytes = zero3_host_cache_cap(cap_bytes)
    op = _host_cache_op() if cap_bytes > 0 or _installed() else None
    if op is None:
        return False
    op.install(int(cap_bytes), MMAP_THRESHOLD_BYTES)
    return cap_bytes > 0


def host_cache_stats() -> dict[str, int]:
    """The cache's counters (``hits``, ``misses``, ``cached_bytes``, ``peak_cached_bytes``, ``cap_bytes``...);
    empty when it was never installed."""
    return dict(_host_cache_op().stats()) if _installed() else {}


_OP: list[Any] = []


def _installed() -> bool:
    return bool(_OP) and _OP[0] is not None and bool(_OP[0].stats()["installed"])


def _host_cache_op() -> Any:
    if not _OP:
        from dsrun.ops.loader import load_op

        _OP.append(load_op("host_cache"))
    return _OP[0]
