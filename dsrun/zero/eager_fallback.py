"""DeepCompile's ZeRO-3 eager fallback: the parameters a compiled forward reads eagerly (across a graph break).

A compiled ZeRO-3 forward gathers its parameters inside its graphs. Code dynamo does not trace (a graph break)
reads parameters through the module's parameter dict (:class:`dsrun.zero.hooks.GatheringParameters`, DeepSpeed's
``ZeROOrderedDict``); while a :class:`DeepCompileZ3EagerFallback` is active (:func:`deepcompile_z3_forward_context`)
such a read gathers the parameter and the fallback owns the gathered copy:

* a parameter gathered by a forward that will run backward stays gathered until that forward's backward has been
  reached and completed (:meth:`record_forward_graph`, :meth:`record_backward_start`, :meth:`complete_backward`),
  then it is released as eager ZeRO-3 releases it; one that no backward needs is released before the next forward;
* dynamo's guards read parameters too (identity and metadata): a read from ``torch._dynamo.guards`` never gathers,
  so a guard check does not hold a full parameter before the compiled forward starts;
* ``GatheredParameters`` over a parameter the fallback owns adopts it (the user's context decides its release),
  and its exit leaves gathered a parameter an outstanding forward still needs.

DeepSpeed's ``deepspeed.compile.z3_eager_fallback``, with the same names and ``stats()`` keys.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Protocol

import torch

from dsrun.zero import parameter_offload
from dsrun.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict
from dsrun.zero.partition_params import ParamStatus, gather_exact, release_param, write_full_value

OWNER_ATTR = "_ds_z3_eager_fallback_owner"  # the fallback that gathered a parameter
CONTEXT_DEPTH_ATTR = "_ds_z3_gathered_param_context_depth"  # GatheredParameters blocks holding it

_ACTIVE_FALLBACK: Any = None


class FallbackEngine(Protocol):
    """What the fallback reads of the engine it serves."""

    module: torch.nn.Module


def get_active_z3_eager_fallback() -> Any:
    """The fallback of the forward running now, or None."""
    return _ACTIVE_FALLBACK


def record_z3_eager_fallback_param(param: torch.nn.Parameter) -> bool:
    """Give a parameter just gathered to the active fallback; False when none is active."""
    if _ACTIVE_FALLBACK is None:
        return False
    _ACTIVE_FALLBACK.record_gathered_param(param)
    return True


def is_dynamo_guard_evaluation() -> bool:
    """Whether the caller runs under dynamo's guard code (a frame of ``torch._dynamo.guards`` on the stack)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch._dynamo.guards":
            return True
        frame = frame.f_back
    return False


def gather_param(param: torch.nn.Parameter, param_list: list[torch.nn.Parameter] | None = None) -> None:
    """Gather ``param_list`` (default ``[param]``): through the parameter's own ``all_gather`` where it has one
    (DeepSpeed's per-parameter method), else dsrun's exact gather."""
    own = param.__dict__.get("all_gather")
    if own is not None:
        own() if param_list is None else own(param_list=param_list)
        return
    gather_exact([param] if param_list is None else param_list)


def partition_param(param: torch.nn.Parameter, param_list: list[torch.nn.Parameter] | None = None,
                    has_been_updated: bool = False) -> None:
    """Release ``param_list`` (default ``[param]``) to their shards: through the parameter's own ``partition``
    where it has one, else dsrun's release (``has_been_updated``: the full values changed and are written back
    to the shards first)."""
    own = param.__dict__.get("partition")
    if own is not None:
        if param_list is None and not has_been_updated:
            own()
        else:
            own(param_list=param_list, has_been_updated=has_been_updated)
        return
    for p in [param] if param_list is None else param_list:
        if has_been_updated:
            write_full_value(p, p.data)
        release_param(p)


def read_param(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A partitioned parameter read through a module's ``_parameters`` while the active fallback's forward
    runs: gathered and owned by the fallback, except for dynamo's guards, which see it as it is."""
    fallback = get_active_z3_eager_fallback()
    if is_dynamo_guard_evaluation():
        if param.ds_status is ParamStatus.NOT_AVAILABLE:
            fallback.record_guard_suppressed_param(param)
        return param
    if param.ds_status is ParamStatus.AVAILABLE:
        fallback.record_param_access(param)
    elif param.ds_status is ParamStatus.NOT_AVAILABLE:
        gather_param(param)
        fallback.record_gathered_param(param)
        parameter_offload.print_rank_0(f"Registering external parameter from getter ds_id = {param.ds_id}",
                                       force=False)
    return param


@contextmanager
def deepcompile_z3_forward_context(engine: object) -> Iterator[Any]:
    """Around an engine's forward: the engine's fallback while DeepCompile runs with ZeRO-3 (else None)."""
    fallback = getattr(engine, "_deepcompile_z3_eager_fallback", None)
    if fallback is None or not getattr(engine, "is_deepcompile_active")() or \
            not getattr(engine, "zero_optimization_partition_weights")():
        yield None
        return
    with fallback.forward_context():
        yield fallback


def _held_by_context(param: torch.nn.Parameter) -> bool:
    return bool(getattr(param, CONTEXT_DEPTH_ATTR, 0))


def _releasable(param: torch.nn.Parameter) -> bool:
    return getattr(param, "ds_status", None) == ParamStatus.AVAILABLE and not getattr(param, "ds_persist", False)


class DeepCompileZ3EagerFallback:
    """The eager ZeRO-3 gathers of one engine's compiled forwards, released when no forward or context needs
    them (see the module docstring)."""

    def __init__(self, engine: FallbackEngine | None):
        self.engine = engine
        self._depth = 0
        self._tracked: dict[int, torch.nn.Parameter] = {}  # ds_id -> a parameter this fallback gathered
        self._current: set[int] = set()  # ds_ids the running forward read
        self._next_graph = 0
        self._outstanding: set[int] = set()  # forwards whose backward has not completed
        self._backward_started: set[int] = set()
        self._graph_params: dict[int, set[int]] = {}  # forward -> ds_ids it needs in backward
        self._param_graphs: dict[int, set[int]] = {}  # ds_id -> forwards needing it
        self._deferred_updates: set[int] = set()  # changed by a modifier_rank context while a forward held them
        self._adopted: set[int] = set()
        self.last: dict[str, list[int]] = {key: [] for key in (
            "gathered", "released", "guard_suppressed", "pre_forward_released", "user_adopted", "completed")}
        self.total_gathered_params = 0

    # --- the forward ----------------------------------------------------------------------------------------
    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Make this the active fallback; the outermost one first releases what no forward holds, and turns the
        modules' gather-on-read on for its length."""
        global _ACTIVE_FALLBACK
        previous = _ACTIVE_FALLBACK
        self._depth += 1
        if self._depth == 1:
            for key in ("gathered", "guard_suppressed", "pre_forward_released"):
                self.last[key] = []
            self._current.clear()
            self.release_available_params_for_next_forward()
            self._set_in_forward(True)
        _ACTIVE_FALLBACK = self
        try:
            yield
        finally:
            _ACTIVE_FALLBACK = previous
            self._depth -= 1
            if self._depth == 0:
                self._set_in_forward(False)

    def _set_in_forward(self, on: bool) -> None:
        for module in self.engine.module.modules():
            if on:
                ensure_zero_ordered_dict(module)
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = on

    def record_gathered_param(self, param: torch.nn.Parameter) -> None:
        """Own ``param``, gathered by a read in this forward (taking it from another fallback owning it)."""
        owner = getattr(param, OWNER_ATTR, None)
        if owner is not None and owner is not self:
            owner._drop(param)
        self._tracked[param.ds_id] = param
        setattr(param, OWNER_ATTR, self)
        self._current.add(param.ds_id)
        self.last["gathered"].append(param.ds_id)
        self.total_gathered_params += 1

    def record_param_access(self, param: torch.nn.Parameter) -> None:
        """A read of a parameter this fallback already holds: the running forward needs it too."""
        if self._tracked.get(param.ds_id) is param:
            self._current.add(param.ds_id)

    def record_guard_suppressed_param(self, param: torch.nn.Parameter) -> None:
        self.last["guard_suppressed"].append(param.ds_id)

    def _drop(self, param: torch.nn.Parameter) -> None:
        ds_id = param.ds_id
        if self._tracked.get(ds_id) is param:
            del self._tracked[ds_id]
        self._current.discard(ds_id)
        for graph in self._param_graphs.pop(ds_id, set()):
            self._graph_params.get(graph, set()).discard(ds_id)
        self._deferred_updates.discard(ds_id)
        if getattr(param, OWNER_ATTR, None) is self:
            delattr(param, OWNER_ATTR)

    # --- GatheredParameters over an owned parameter ---------------------------------------------------------
    def record_user_context_claim(self, param: torch.nn.Parameter) -> None:
        if param.ds_id not in self._adopted:
            self._adopted.add(param.ds_id)
            self.last["user_adopted"].append(param.ds_id)

    def release_user_context_claim(self, param: torch.nn.Parameter) -> None:
        """The user's context ended: forget ``param`` unless a forward or another context still holds it."""
        if not self._param_graphs.get(param.ds_id) and not _held_by_context(param):
            self._drop(param)

    def has_outstanding_graph_claim(self, param: torch.nn.Parameter) -> bool:
        return bool(self._param_graphs.get(param.ds_id))

    def record_deferred_user_update(self, param: torch.nn.Parameter) -> None:
        self._deferred_updates.add(param.ds_id)

    # --- backward -------------------------------------------------------------------------------------------
    def record_forward_graph(self) -> int:
        """A forward whose outputs will run backward: what it read stays gathered until that backward."""
        graph = self._next_graph
        self._next_graph += 1
        self._outstanding.add(graph)
        self._graph_params[graph] = set(self._current)
        for ds_id in self._current:
            self._param_graphs.setdefault(ds_id, set()).add(graph)
        return graph

    def record_backward_start(self, graph: int | None) -> None:
        if graph in self._outstanding:
            self._backward_started.add(graph)  # type: ignore[arg-type]

    def complete_backward(self) -> None:
        """After a backward: release what only the forwards it reached held."""
        done = sorted(self._backward_started)
        if not done:
            return
        self._backward_started.clear()
        self._outstanding.difference_update(done)
        for graph in done:
            for ds_id in self._graph_params.pop(graph, set()):
                graphs = self._param_graphs.get(ds_id)
                if graphs is not None:
                    graphs.discard(graph)
                    if not graphs:
                        del self._param_graphs[ds_id]
        self.last["completed"] = done
        self.last["released"] = self._release_unclaimed()

    def release_gathered_params(self) -> None:
        """Give up every pending backward (training abandoned it) and release what only those held."""
        self._outstanding.clear()
        self._backward_started.clear()
        self._graph_params.clear()
        self._param_graphs.clear()
        self.last["released"] = self._release_unclaimed()

    @torch.no_grad()
    def _release_unclaimed(self) -> list[int]:
        released = []
        for ds_id, param in list(self._tracked.items()):
            if self._param_graphs.get(ds_id) or _held_by_context(param):
                continue
            if _releasable(param):
                partition_param(param, has_been_updated=True) if ds_id in self._deferred_updates \
                    else partition_param(param)
                released.append(ds_id)
            self._drop(param)
        return released

    @torch.no_grad()
    def release_available_params_for_next_forward(self) -> None:
        """Before a forward: the partitioned state dynamo's guards expect. Releases what this fallback holds
        unclaimed and, when no backward is pending, every gathered parameter of the model no context holds."""
        released = self._release_unclaimed()
        if not self._outstanding and self.engine is not None:
            for param in self.engine.module.parameters():
                if hasattr(param, "ds_status") and _releasable(param) and not _held_by_context(param):
                    partition_param(param)
                    released.append(param.ds_id)
        self.last["pre_forward_released"] = released

    def stats(self) -> dict[str, Any]:
        """DeepSpeed's diagnostic view (ds_id lists, sorted where they are sets)."""
        return {
            "tracked_param_ids": sorted(self._tracked),
            "last_gathered_param_ids": list(self.last["gathered"]),
            "last_released_param_ids": list(self.last["released"]),
            "last_guard_suppressed_param_ids": list(self.last["guard_suppressed"]),
            "last_pre_forward_released_param_ids": list(self.last["pre_forward_released"]),
            "last_user_adopted_param_ids": list(self.last["user_adopted"]),
            "current_forward_param_ids": sorted(self._current),
            "outstanding_forward_graph_ids": sorted(self._outstanding),
            "backward_started_forward_graph_ids": sorted(self._backward_started),
            "graph_claim_param_ids": {g: sorted(ids) for g, ids in sorted(self._graph_params.items())},
            "param_graph_claim_ids": {i: sorted(gs) for i, gs in sorted(self._param_graphs.items())},
            "context_claimed_param_ids": sorted(i for i, p in self._tracked.items() if _held_by_context(p)),
            "deferred_updated_param_ids": sorted(self._deferred_updates),
            "last_completed_forward_graph_ids": list(self.last["completed"]),
            "total_gathered_params": self.total_gathered_params,
        }
