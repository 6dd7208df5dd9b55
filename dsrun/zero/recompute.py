"""ZeRO-3 around an activation-checkpoint recompute: the parameters gathered when it starts are gathered when
it ends.

A recompute runs the checkpointed modules' forward again, hooks included, and ZeRO-3's forward hook releases
a module's parameters when its forward ends. The module whose backward triggered the recompute had just
been gathered for that backward (and autograd is about to accumulate into its parameters' ``.grad``), so
without this its parameters would be left released. The tensors the recompute saved need nothing: they
alias the gathered buffers, which stay valid after a release. Registered with activation checkpointing's
guards when the ZeRO-3 hooks are imported.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from dsrun.activation_checkpointing.guards import register_recompute_guard

from dsrun.zero.partition_params import ParamStatus, gather_params


def register(coordinators: Iterable) -> None:
    """Keep the parameters of the live ZeRO-3 ``coordinators`` (a live view, read at each recompute)."""

    @contextlib.contextmanager
    def zero3_parameters_kept() -> Iterator[None]:
        available = [p for coordinator in list(coordinators) for p in coordinator.params.values()
                     if p.ds_status is ParamStatus.AVAILABLE]
        yield
        gather_params([p for p in available if p.ds_status is not ParamStatus.AVAILABLE])

    register_recompute_guard(zero3_parameters_kept)
