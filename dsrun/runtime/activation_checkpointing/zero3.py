"""ZeRO-3 around a recompute: the parameters gathered when it starts are gathered when it ends.

A recompute runs the checkpointed modules' forward again, hooks included, and ZeRO-3's forward hook releases
a module's parameters when its forward ends. The module whose backward triggered the recompute had just
been gathered for that backward (and autograd is about to accumulate into its parameters' ``.grad``), so
without this its parameters would be left released. The tensors the recompute saved need nothing: they
alias the gathered buffers, which stay valid after a release.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def zero3_parameters_kept() -> Iterator[None]:
    """Gather again, after the ``with`` block, the ZeRO-3 parameters that were available before it."""
    from dsrun.runtime.zero.hooks import LIVE_COORDINATORS
    from dsrun.runtime.zero.partition_params import ParamStatus, gather_params

    available = [p for coordinator in list(LIVE_COORDINATORS) for p in coordinator.params.values()
                 if p.ds_status is ParamStatus.AVAILABLE]
    yield
    gather_params([p for p in available if p.ds_status is not ParamStatus.AVAILABLE])
