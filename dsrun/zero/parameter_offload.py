"""DeepSpeed's ``runtime.zero.parameter_offload`` names for a module's parameter dict.

In DeepSpeed this module holds the ZeRO-3 forward/backward hook manager (``DeepSpeedZeRoOffload``); dsrun's is
:class:`dsrun.zero.hooks.ParameterCoordinator`, built by the ZeRO-3 strategy, and is not served under that name.
What scripts and DeepSpeed's tests take from here is the parameter dict:

* :data:`ZeROOrderedDict` is :class:`dsrun.zero.hooks.GatheringParameters`: the ``_parameters`` of every module
  holding partitioned parameters once a ZeRO-3 engine hooks the model, which gathers a partitioned parameter
  read inside a forward and makes it an external parameter of the module running.
* :func:`ensure_zero_ordered_dict` wraps a module's plain ``_parameters`` in one (idempotent). A dict made so
  gathers nothing until a coordinator adopts it: dsrun's hook the modules a model held when the engine was built.
* :func:`print_rank_0` is the trace line a read inside DeepCompile's ZeRO-3 eager fallback writes
  (:mod:`dsrun.compile.z3_eager_fallback`): printed on rank 0 with ``force=True``, else logged at debug level.
"""
from __future__ import annotations

from dsrun.utils.logging import log_dist, logger
from dsrun.zero.hooks import GatheringParameters

__all__ = ["ZeROOrderedDict", "ensure_zero_ordered_dict", "print_rank_0"]

ZeROOrderedDict = GatheringParameters


def ensure_zero_ordered_dict(module: object) -> None:
    """Make ``module._parameters`` a :data:`ZeROOrderedDict` holding the same entries, unless it is one already,
    is missing or is not a dict. The container replaced is kept as ``module._original_parameters`` the first
    time only (a later wrap must not lose the torch-native one)."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params  # type: ignore[attr-defined]
    module._parameters = ZeROOrderedDict(module, params)  # type: ignore[attr-defined]


def print_rank_0(message: str, debug: bool = False, force: bool = False) -> None:
    """DeepSpeed's parameter-offload trace line: on rank 0 when ``debug`` or ``force``, else a debug log."""
    if debug or force:
        log_dist(message, ranks=[0])
    else:
        logger.debug(message)
