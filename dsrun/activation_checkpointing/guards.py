"""What must hold around a recompute, registered by the rooms that know it.

A recompute runs checkpointed modules' forward again, hooks included. A parallelism whose hooks change state
in a forward (ZeRO-3 releases a module's parameters when its forward ends) registers a guard here: a
context-manager factory entered around every recompute. Activation checkpointing sits below those rooms and
never imports them; they import this and register (``dsrun/zero/recompute.py`` does for ZeRO-3).
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator

RecomputeGuard = Callable[[], ContextManager[None]]
_GUARDS: list[RecomputeGuard] = []


def register_recompute_guard(guard: RecomputeGuard) -> None:
    """Enter ``guard()`` around every recompute from now on (registering the same guard twice is one)."""
    if guard not in _GUARDS:
        _GUARDS.append(guard)


@contextlib.contextmanager
def recompute_guarded() -> Iterator[None]:
    """Every registered guard, entered in registration order, around a recompute."""
    with contextlib.ExitStack() as stack:
        for guard in list(_GUARDS):
            stack.enter_context(guard())
        yield
