"""``disable_python_gc``: Python's automatic cyclic garbage collection off while engines train (DeepSpeed's
``deepspeed.runtime.python_gc``: ``python_gc_manager``, served under that path by the alias).

A generation-2 collection stops one rank for tens to hundreds of milliseconds at a moment the allocator picks,
and the other ranks wait for it at the next collective. With the key on, an engine takes a *lease* when it is
built: the first lease collects once and turns automatic collection off (reference counting still frees
everything that is not in a cycle); the last lease given back (``engine.destroy()``) turns it on again, unless
it was already off before. The training script collects cycles where every rank can afford it, at the same
step on every rank: ``engine.collect_python_gc()``. A process forked while leases are held starts with
collection on and no leases (a data-loader worker is not an engine).
"""
from __future__ import annotations

import gc
import os
import threading

from dsrun.utils.logging import logger


class PythonGCManager:
    """The process-wide policy, counted over the engines that asked for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._leases = 0
        self._was_enabled = False  # whether automatic collection was on when the first lease was taken
        self._epoch = 0  # bumped in a forked child: leases taken by the parent are not the child's to give back
        if hasattr(os, "register_at_fork"):
            # through lambdas: a forked child replaces its lock, and forks again with the new one
            os.register_at_fork(before=lambda: self._lock.acquire(), after_in_parent=lambda: self._lock.release(),
                                after_in_child=self._forked)

    def _forked(self) -> None:
        if self._leases and self._was_enabled:
            gc.enable()
        self._leases, self._was_enabled = 0, False
        self._epoch += 1
        self._lock = threading.RLock()

    def acquire(self) -> int:
        """Take a lease; the first one collects and turns automatic collection off. Returns the lease's token."""
        with self._lock:
            if self._leases == 0:
                self._was_enabled = gc.isenabled()
                if self._was_enabled:
                    found = gc.collect()
                    gc.disable()
                    logger.info(f"disable_python_gc: automatic cyclic GC off (collected {found} objects first)")
            self._leases += 1
            return self._epoch

    def release(self, token: int) -> None:
        """Give a lease back; the last one turns automatic collection on again if it was on before."""
        with self._lock:
            if token != self._epoch or self._leases == 0:
                return
            self._leases -= 1
            if self._leases == 0:
                restore, self._was_enabled = self._was_enabled, False
                if restore and not gc.isenabled():
                    gc.enable()
                    logger.info("disable_python_gc: automatic cyclic GC on again")

    @staticmethod
    def collect() -> int:
        """Collect cycles now, leaving the policy as it is; returns what ``gc.collect()`` found."""
        return gc.collect()

    @property
    def active_engines(self) -> int:
        with self._lock:
            return self._leases


python_gc_manager = PythonGCManager()
