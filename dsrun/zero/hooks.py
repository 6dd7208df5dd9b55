"""When ZeRO-3 parameters are gathered and released: module hooks, the recorded trace, prefetch, reuse.

Every submodule that owns parameters (or has external ones, ``dsrun.zero.register_external_parameter``) gets
a forward pre-hook that gathers them and a forward hook that releases them and routes the module's outputs
through :class:`_GatherBeforeBackward`, an identity whose backward gathers them again before autograd
reaches the module's own backward (whose saved tensors then see the full ``.data``). Trainable
parameters are released during backward as soon as their gradient is complete (the ZeRO-3 strategy calls
:meth:`ParameterCoordinator.release_after_grad`); anything still gathered is released when backward ends.
A fetch's (and a prefetch bucket's) parameters travel in one collective (:mod:`.coalesced_gather`).
Which parameters each module gathers (its own, external ones, a leaf's subtree) is :mod:`.module_gathers`.

The first forward+backward records the order modules fetch their parameters (the *trace*). From then on:

* ``stage3_prefetch_bucket_size``: after a module's fetch, the next modules' parameters in the trace are
  all-gathered asynchronously, up to that many elements in flight, so communication overlaps compute. A
  parameter whose shard is in an NVMe file is gathered ahead only once it has been read: the offload reads
  ahead, in the trace's order, the shards the coming fetches will read
  (:meth:`ParameterCoordinator.upcoming_reads`).
* ``stage3_max_reuse_distance``: a parameter whose next use comes within that many gathered elements is
  not released after a forward (typically the last layers, used again right away by backward).
* ``stage3_max_live_parameters``: neither prefetching nor keeping for reuse may push the gathered elements
  beyond this.

On the CPU, released full buffers are kept in a :class:`~.partition_params.GatherBufferPool` for the next
gathers of the same size, up to what one module's fetch gathers (:meth:`ParameterCoordinator.largest_fetch_numel`:
the exchange between one release and the next fetch; glibc's heap reuses the rest, ZeRO-3 pinning its mmap
threshold above that size, :mod:`.host_memory`).

A ZeRO-3 *leaf* module (``deepspeed.utils.set_z3_leaf_modules``: :mod:`dsrun.utils.leaf_modules`) is hooked as
one: its pre-hook gathers every parameter of its subtree (and the external ones registered anywhere in it), its
forward hook releases them, and its children get no hooks, so a Mixture-of-Experts block whose experts run
data-dependently issues the same gathers on every rank. Its subtree's parameters are marked ``ds_z3_leaf_module``
(DeepSpeed's ``z3_leaf_parameter``); the ZeRO-3 strategy reduces their gradients once backward is done
(:mod:`.stage3`). Flags set after the coordinator is built take effect only with a new one (a new engine).

A parameter read outside its own module's forward (``nn.MultiheadAttention`` hands ``out_proj.weight`` to
``F.multi_head_attention_forward`` without calling ``out_proj``; ``nn.TransformerEncoderLayer``'s inference
path reads its children's weights; a tied head written as ``x @ self.wte.weight.T``) is gathered when it is
read: every module holding partitioned parameters gets a :class:`GatheringParameters` dict, whose lookup of
an unavailable parameter during a forward gathers it and registers it as an external parameter of the
innermost hooked module running, so from then on that module's own hooks gather it before its forward and
its backward (DeepSpeed does the same). Lookups of available parameters cost one status check.

Under ``torch.compile`` (:mod:`.compile_regions`) the hooks are ``torch.compiler.disable``d and the compiled
blocks are gathered whole, as leaves are but with their gradients reduced as they are ready
(:meth:`ParameterCoordinator.compile_regions`).

All of this is deterministic given the trace, so every rank issues the same collectives in the same order
(ZeRO-3 assumes the ranks run the same modules in the same order, as DeepSpeed does). If a step's order
differs from the trace, prefetch and reuse stop for the rest of that step and the trace is recorded again.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from itertools import groupby
from typing import Any, Iterable, Iterator

import torch

from torch.autograd.function import FunctionCtx
from torch.utils._pytree import tree_flatten, tree_unflatten

from dsrun.utils.leaf_modules import PARAM_LEAF_ATTR, z3_leaf_module
from dsrun.zero import recompute
from dsrun.zero.coalesced_gather import FetchMode, gather_params_with, start_gathers
from dsrun.zero.module_gathers import add_external_param, gathered_params, gathered_whole, hooked_modules
from dsrun.zero.partition_params import (GatherBufferPool, ParamStatus, gather_params, is_zero_param, mark_stale,
                                         release_param)

FORWARD, BACKWARD = "fwd", "bwd"

# coordinators alive in this process, so a late register_external_parameter can hook its module
LIVE_COORDINATORS: "weakref.WeakSet[ParameterCoordinator]" = weakref.WeakSet()
recompute.register(LIVE_COORDINATORS)  # activation-checkpoint recomputes keep what was gathered


class GatheringParameters(dict):
    """A module's ``_parameters`` that gathers a partitioned parameter read while a forward runs (see the
    module docstring); DeepSpeed's ``ZeROOrderedDict`` (``GatheringParameters(parent_module, params)``, as
    DeepSpeed builds it). It gathers once its ``coordinator`` is set (the coordinator hooking the module sets
    it); until then it is a plain dict. Pickles and copies as a plain dict."""

    def __init__(self, parent_module: torch.nn.Module | None, *args: object, **kwargs: object):
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self.coordinator: ParameterCoordinator | None = None
        self._in_forward = False  # set by DeepCompile's ZeRO-3 eager fallback (dsrun.zero.eager_fallback)

    def __getitem__(self, name: str) -> Any:
        param = dict.__getitem__(self, name)
        if param is None or not hasattr(param, "ds_status"):
            return param
        if self._in_forward and not torch.compiler.is_compiling():
            # DeepCompile's ZeRO-3 eager fallback owns reads inside a compiled forward; only its module sets
            # _in_forward (it is loaded whenever one is active)
            fallback = sys.modules.get("dsrun.zero.eager_fallback")
            if fallback is not None and fallback.get_active_z3_eager_fallback() is not None:
                return fallback.read_param(param)
        if self.coordinator is not None and param.ds_status is not ParamStatus.AVAILABLE:
            self.coordinator.gather_on_read(param)
        return param

    def __reduce__(self) -> Any:
        return dict, (dict(self),)


class ParameterCoordinator:
    """Gathers and releases the partitioned parameters of one model around its modules' passes."""

    def __init__(self, root: torch.nn.Module, prefetch_bucket_size: int = 0, max_live_parameters: int = 10**9,
                 max_reuse_distance: int = 10**9, log_trace_cache_warnings: bool = False,
                 coalesced: bool = False, all_reduce: bool = False):
        self.root = root
        # zero_optimization.log_trace_cache_warnings: say when a pass leaves the recorded order (DeepSpeed's
        # "Invalidate trace cache" lines); the prefetching stops until the next pass records the order again
        self.log_trace_cache_warnings = log_trace_cache_warnings
        self.prefetch_bucket_size = int(prefetch_bucket_size)
        self.max_live_parameters = int(max_live_parameters)
        self.max_reuse_distance = int(max_reuse_distance)
        self._hooks: list[Any] = []
        self._hooked: dict[int, torch.nn.Module] = {}
        self.trace: list[tuple[int, str]] = []
        self.trace_complete = False
        self.cursor = 0
        self.following_trace = False
        self._off_trace = False  # this pass left the recorded order
        self._keep_after: dict[int, set[int]] = {}  # trace index -> ids of params kept after that forward
        self._released_after: list[set[int]] = []  # trace index -> ids of params released once it is over
        self._forward_index: dict[int, int] = {}  # module -> its event's index in the trace, during its forward
        self.in_use: dict[int, int] = {}
        self.params: dict[int, torch.nn.Parameter] = {}
        self._params_of: dict[int, list[torch.nn.Parameter]] = {}  # module id -> module_params(module)
        self.total_numel = 0
        self.prefetched_numel = 0  # statistics: elements gathered ahead of use
        # called after each fetch with the parameters the trace needs next (NVMe offload reads them ahead)
        self.after_fetch: Any = None
        # called when backward reaches a module, before its parameters are gathered (the ZeRO-3 strategy
        # reduces there, on the CPU, the gradients of the modules whose backward is done)
        self.before_backward: Any = None
        self.buffer_pool = GatherBufferPool(0)  # sized by hook_module (largest_fetch_numel)
        # stage3_allgather_sequential false: one collective per fetch, its flat output from a pool of its own
        # (a fetch's and a prefetch's in flight at once); stage3_use_all_reduce_for_fetch_params: an all-reduce
        self.fetch_mode = FetchMode(coalesced=coalesced, all_reduce=all_reduce, scratch=GatherBufferPool(0))
        self._running: list[torch.nn.Module] = []  # hooked modules inside their forward, innermost last
        self._reading: list[torch.nn.Module] = []  # modules whose _parameters gather on read
        self._leaf_of: dict[int, torch.nn.Module] = {}  # a module inside a leaf -> the leaf hooked for it
        self._leaf_params: list[torch.nn.Parameter] = []
        self.units: frozenset[int] = frozenset()  # compile regions gathered whole (compile_regions)
        self._hook_fns: tuple[Any, Any] = (self._pre_forward, self._post_forward)
        self.lifted = False  # inside unhooked(): the caller holds every parameter gathered
        self._install()

    # --- hooks --------------------------------------------------------------------------------------------
    def _install(self) -> None:
        root = self.root
        for _, module in hooked_modules(root, self.units):
            if gathered_whole(module, self.units):
                self._mark_leaf(module)
        self.hook_module(root)  # even without parameters: its forward is where a read has no other owner
        for _, module in hooked_modules(root, self.units):
            if gathered_params(module, self.units):
                self.hook_module(module)
        for module in root.modules():  # inside leaves too: a read outside the leaf's forward still gathers
            if any(is_zero_param(p) for p in module._parameters.values()):
                module._parameters = GatheringParameters(module, module._parameters)
                module._parameters.coordinator = self
                self._reading.append(module)
        LIVE_COORDINATORS.add(self)

    def compile_regions(self, units: Iterable[torch.nn.Module]) -> None:
        """Get ready for ``torch.compile`` (:mod:`dsrun.zero.compile_regions`): the hooks become opaque to dynamo
        (``torch.compiler.disable``: their bookkeeping and collectives run eagerly, and a compiled forward that
        reaches them breaks its graph once there instead of tracing them and guarding on their state), and each
        module of ``units`` is gathered whole, as a leaf is, so a compiled unit's forward runs with every
        parameter of its subtree gathered, its children unhooked: no break inside it. The recorded trace starts
        again. Units are not leaves: their parameters' gradients are reduced as they are ready."""
        self.remove_hooks()
        self.units = frozenset(id(u) for u in units)
        self._hook_fns = (torch.compiler.disable(self._pre_forward), torch.compiler.disable(self._post_forward))
        self._reinstall()

    def _reinstall(self) -> None:
        """Hook the model again after :meth:`remove_hooks`, recording the order of the next pass anew."""
        self._params_of, self.params = {}, {}
        self.trace, self.trace_complete, self.following_trace, self._keep_after = [], False, False, {}
        self._released_after = []
        self.in_use.clear()
        self._install()

    @contextlib.contextmanager
    def unhooked(self) -> Iterator[None]:
        """No hooks (and no gathering on read) inside: for a caller that gathered every parameter itself
        (DeepSpeed's ``unwrap_model_for_generation``). The pass boundaries inside (an engine's forward or backward:
        :meth:`begin_forward`, :meth:`release_after_grad`, :meth:`end_backward`) release nothing and record no
        order, so what the caller gathered stays gathered for the block. The hooks come back on exit; the next
        pass records its order again, as a pass that left the recorded order would."""
        self.remove_hooks()
        self.lifted = True
        try:
            yield
        finally:
            self.lifted = False
            self._reinstall()

    def _mark_leaf(self, leaf: torch.nn.Module) -> None:
        for inner in leaf.modules():
            if inner is not leaf:
                self._leaf_of.setdefault(id(inner), leaf)
        if not z3_leaf_module(leaf):
            return  # a compile region: gathered whole, gradients reduced as usual
        for p in leaf.parameters():  # its own subtree's, as DeepSpeed marks them (not external ones)
            if is_zero_param(p):
                setattr(p, PARAM_LEAF_ATTR, leaf)
                self._leaf_params.append(p)

    def hook_module(self, module: torch.nn.Module) -> None:
        """Gather ``module``'s parameters around its passes (again: refresh its list after a registration). A
        module inside a leaf is never hooked: its leaf is, and gathers what was registered on it too."""
        module = self._leaf_of.get(id(module), module)
        self._params_of[id(module)] = gathered_params(module, self.units)
        for p in self._params_of[id(module)]:
            self.params[id(p)] = p
            if p.ds_tensor.device.type == "cpu":  # CUDA's caching allocator reuses memory already
                p.ds_buffer_pool = self.buffer_pool
        self.total_numel = sum(p.ds_numel for p in self.params.values())
        self.buffer_pool.limit = self.largest_fetch_numel()
        self.fetch_mode.scratch.limit = 2 * self.buffer_pool.limit
        if id(module) in self._hooked:
            return
        self._hooked[id(module)] = module
        pre_forward, post_forward = self._hook_fns
        self._hooks.append(module.register_forward_pre_hook(pre_forward))
        self._hooks.append(module.register_forward_hook(post_forward))

    def largest_fetch_numel(self) -> int:
        """The most elements one module's fetch gathers (its parameters that are not kept gathered): the
        released buffers the next fetches reuse, so the CPU buffer pool's size, and the largest gather and
        per-module gradient bucket, so the mmap threshold ZeRO-3 pins on the CPU (:mod:`.host_memory`)."""
        return max((sum(p.ds_numel for p in params if not p.ds_persist) for params in self._params_of.values()),
                   default=0)

    def remove_hooks(self) -> None:
        for p in self.params.values():
            if getattr(p, "ds_buffer_pool", None) is self.buffer_pool:
                p.ds_buffer_pool = None
        self.buffer_pool.clear()
        self.fetch_mode.scratch.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._hooked = {}
        for module in self._reading:
            if isinstance(module._parameters, GatheringParameters):
                module._parameters = dict(module._parameters)
        self._reading = []
        for p in self._leaf_params:
            if hasattr(p, PARAM_LEAF_ATTR):
                delattr(p, PARAM_LEAF_ATTR)
        self._leaf_params = []
        self._leaf_of = {}

    def gather_on_read(self, param: torch.nn.Parameter) -> None:
        """``param`` was read while unavailable: inside a forward, gather it now and make it an external
        parameter of the innermost running hooked module, so that module's hooks gather it from now on (in
        this pass's backward too). Outside a forward nothing is gathered, as in DeepSpeed."""
        if not self._running:
            return
        module = self._running[-1]
        add_external_param(module, param)
        self.hook_module(module)
        gather_params([param])

    def _pre_forward(self, module: torch.nn.Module, inputs: tuple[object, ...]) -> None:
        self._running.append(module)
        params = self._params_of.get(id(module), [])
        if not params:
            return
        self._fetch(module, FORWARD, params)
        if self.following_trace:
            self._forward_index[id(module)] = self.cursor - 1
        for p in params:
            self.in_use[id(p)] = self.in_use.get(id(p), 0) + 1

    def _post_forward(self, module: torch.nn.Module, inputs: tuple[object, ...], output: object) -> object:
        if self._running and self._running[-1] is module:
            self._running.pop()
        params = self._params_of.get(id(module), [])
        if not params:
            return None
        keep: set[int] = set()
        if self.following_trace and id(module) in self._forward_index:
            keep = self._keep_after.get(self._forward_index.pop(id(module)), set())
        for p in params:
            self.in_use[id(p)] = max(0, self.in_use.get(id(p), 0) - 1)
            if self.in_use[id(p)] or p.ds_persist:
                continue
            if id(p) in keep and self.live_numel() <= self.max_live_parameters:
                continue
            release_param(p)
        return _gather_before_backward(self, module, output)

    def _pre_backward(self, module: torch.nn.Module) -> None:
        if self.before_backward is not None:
            self.before_backward()
        params = self._params_of.get(id(module), [])
        if params:
            self._fetch(module, BACKWARD, params)

    # --- fetching -----------------------------------------------------------------------------------------
    def _fetch(self, module: torch.nn.Module, phase: str, params: list[torch.nn.Parameter]) -> None:
        self._record(module, phase)
        # backward (and a recompute inside it) gathers from the hpZ secondary partitions where there are any
        gather_params_with(params, phase == BACKWARD or torch._C._current_graph_task_id() != -1, self.fetch_mode)
        if self.following_trace and self.prefetch_bucket_size > 0:
            self._prefetch()
        if self.after_fetch is not None and self.following_trace:
            self.after_fetch(self.upcoming_reads())

    def upcoming_params(self) -> Iterable[torch.nn.Parameter]:
        """The parameters the recorded trace fetches after the current position, in order."""
        for p, _ in self._upcoming():
            yield p

    def upcoming_reads(self) -> Iterator[torch.nn.Parameter]:
        """The parameters whose shards the recorded trace will read after the current position, in order: a
        fetch that finds its parameter still gathered (prefetched, kept for reuse, or a tied one whose gradient
        is not complete yet) reads nothing. Each parameter is gathered until the release the trace plans for
        it (:meth:`_plan_releases`), so one that is gathered now, or will be, is read again only after that.
        NVMe parameter offload reads these ahead: a shard read for a fetch that does not need it holds a pool
        buffer until a later fetch takes it or a read needed sooner evicts it (then read again)."""
        gathered = {pid for pid, p in self.params.items() if p.ds_status is not ParamStatus.NOT_AVAILABLE}
        if 0 < self.cursor <= len(self._released_after):  # the module fetched now releases them after it
            module_id, phase = self.trace[self.cursor - 1]
            if phase == FORWARD and self.live_numel() > self.max_live_parameters:
                gathered -= {id(p) for p in self._params_of.get(module_id, [])}  # too many gathered to keep any
            else:
                gathered -= self._released_after[self.cursor - 1]
        for index in range(self.cursor, len(self.trace)):
            module_id, phase = self.trace[index]
            for p in self._params_of.get(module_id, []):
                if id(p) in gathered or p.ds_persist:
                    continue
                gathered.add(id(p))
                # hpZ: backward gathers from the secondary partition, refreshed by the forward's gather
                if not (phase == BACKWARD and getattr(p, "ds_secondary_tensor", None) is not None):
                    yield p
            if index < len(self._released_after):
                gathered -= self._released_after[index]

    def _upcoming(self) -> Iterable[tuple[torch.nn.Parameter, str]]:
        for index in range(self.cursor, len(self.trace)):
            module_id, phase = self.trace[index]
            for p in self._params_of.get(module_id, []):
                yield p, phase

    def _record(self, module: torch.nn.Module, phase: str) -> None:
        event = (id(module), phase)
        if self._off_trace:
            return  # this pass left the trace; the next one records afresh
        if not self.trace_complete:
            self.trace.append(event)
            return
        if self.following_trace:
            if self.cursor < len(self.trace) and self.trace[self.cursor] == event:
                self.cursor += 1
                return
            # The model took another path than the recorded one: stop predicting, record again next step.
            if self.log_trace_cache_warnings:
                self._warn_invalidated(module, phase)
            self.following_trace = False
            self.trace_complete = False
            self.trace = []
            self._keep_after = {}
            self._released_after = []
            self._off_trace = True

    def _warn_invalidated(self, module: torch.nn.Module, phase: str) -> None:
        from dsrun.utils.logging import log_dist

        if self.cursor >= len(self.trace):
            why = f"cache has only {len(self.trace)} module events"
        else:
            expected = self._hooked.get(self.trace[self.cursor][0])
            why = (f"expected {type(expected).__name__ if expected is not None else 'a module'} "
                   f"({self.trace[self.cursor][1]}), but got {type(module).__name__} ({phase})")
        log_dist(f"Invalidate trace cache @ step {self.cursor}: {why}", ranks=[0], level=logging.WARNING)

    def _prefetch(self) -> None:
        budget = self.prefetch_bucket_size
        live = self.live_numel()
        bucket: list[tuple[torch.nn.Parameter, str]] = []  # gathered after the loop, in one go
        seen: set[int] = set()
        for p, phase in self._upcoming():
            if p.ds_status is not ParamStatus.NOT_AVAILABLE or id(p) in seen:
                continue
            if budget <= 0 or live + p.ds_numel > self.max_live_parameters:
                break
            owner = getattr(p, "ds_offload", None)
            from_shard = not (phase == BACKWARD and getattr(p, "ds_secondary_valid", False))
            if owner is not None and from_shard and not owner.in_memory(p):
                # a shard still in its NVMe file: the offload's read-ahead reads it in the trace's order;
                # gathering it here would read it out of turn, into a buffer a shard needed sooner holds
                break
            bucket.append((p, phase))
            seen.add(id(p))
            budget -= p.ds_numel
            live += p.ds_numel
            self.prefetched_numel += p.ds_numel
        # in runs of one phase (backward reads hpZ's secondary partitions): one collective each when coalesced
        for phase, run in groupby(bucket, key=lambda item: item[1]):
            start_gathers([p for p, _ in run], async_op=True, secondary=phase == BACKWARD, mode=self.fetch_mode)

    def live_numel(self) -> int:
        """Elements currently gathered (or being gathered)."""
        if self.total_numel <= self.max_live_parameters:
            return 0  # the limit cannot be reached: skip the count
        return sum(p.ds_numel for p in self.params.values() if p.ds_status is not ParamStatus.NOT_AVAILABLE)

    # --- pass boundaries (called by the strategy) ---------------------------------------------------------
    def begin_forward(self) -> None:
        """A new forward starts: release what an earlier pass kept, and follow the trace if there is one."""
        if self.lifted:
            return
        self.release_all(keep_persistent=True)
        self.cursor = 0
        self.following_trace = self.trace_complete
        self._off_trace = False
        self._running = []  # a forward that raised left its modules here

    def release_after_grad(self, param: torch.nn.Parameter) -> None:
        if not param.ds_persist and not self.lifted:
            release_param(param)

    def end_backward(self) -> None:
        """Backward finished: release everything not persistent; the first time, finish the trace."""
        if self.lifted:
            return
        self.release_all(keep_persistent=True)
        if not self.trace_complete and self.trace:
            self.trace_complete = True
            self._plan_reuse()
            self._plan_releases()
        self.following_trace = False
        self.in_use.clear()

    def release_all(self, keep_persistent: bool) -> None:
        for p in self.params.values():
            if keep_persistent and p.ds_persist:
                continue
            if not self.in_use.get(id(p)):
                release_param(p)

    def invalidate(self) -> None:
        """The shards changed (an optimizer step): every gathered copy, persistent ones included, is stale. Inside
        :meth:`unhooked` what the caller held gathered is gathered again, with the new values."""
        held = [p for p in self.params.values() if self.lifted and p.ds_status is not ParamStatus.NOT_AVAILABLE]
        for p in self.params.values():
            release_param(p)
            mark_stale(p)
        gather_params(held)

    def _plan_releases(self) -> None:
        """For each event of the trace, the parameters released once it is over: a forward releases its
        module's parameters unless they are kept for reuse (:meth:`_plan_reuse`); in backward a trainable
        parameter is released when its gradient is complete, after the last backward that uses it (a tied
        weight stays gathered from its first backward to its last), a leaf module's or a frozen one only
        when backward ends."""
        last_backward: dict[int, int] = {}
        for index, (module_id, phase) in enumerate(self.trace):
            if phase == BACKWARD:
                for p in self._params_of.get(module_id, []):
                    last_backward[id(p)] = index
        self._released_after = []
        for index, (module_id, phase) in enumerate(self.trace):
            params = self._params_of.get(module_id, [])
            if phase == FORWARD:
                keep = self._keep_after.get(index, set())
                released = {id(p) for p in params if id(p) not in keep}
            else:
                released = {id(p) for p in params if last_backward[id(p)] == index and p.requires_grad
                            and getattr(p, PARAM_LEAF_ATTR, None) is None}
            self._released_after.append(released)

    def _plan_reuse(self) -> None:
        """For each forward event, which of its parameters are used again within ``max_reuse_distance``
        gathered elements (counted over the modules fetched in between)."""
        self._keep_after = {}
        sizes = []
        params_at = []
        for module_id, _ in self.trace:
            ps = self._params_of.get(module_id, [])
            params_at.append({id(p) for p in ps})
            sizes.append(sum(p.ds_numel for p in ps))
        for i, (_, phase) in enumerate(self.trace):
            if phase != FORWARD:
                continue
            keep: set[int] = set()
            for pid in params_at[i]:
                distance = 0
                for j in range(i + 1, len(self.trace)):
                    if pid in params_at[j]:
                        if distance <= self.max_reuse_distance:
                            keep.add(pid)
                        break
                    distance += sizes[j]
                    if distance > self.max_reuse_distance:
                        break
            if keep:
                self._keep_after[i] = keep


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward gathers the module's parameters before autograd runs
    the module's own backward (which reads them through its saved tensors)."""

    @staticmethod
    def forward(ctx: FunctionCtx, coordinator: ParameterCoordinator, module: torch.nn.Module,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.coordinator, ctx.module = coordinator, module
        return tuple(t.detach() for t in tensors)  # detached, not views: callers may modify them in place

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.coordinator._pre_backward(ctx.module)
        return (None, None) + grads


def _gather_before_backward(coordinator: ParameterCoordinator, module: torch.nn.Module, output: object) -> object:
    """``output`` (whatever the module returned: a tensor or any nest of them) with its differentiable tensors
    routed through :class:`_GatherBeforeBackward` (None: no tensor needs it, keep the output as it is)."""
    if not torch.is_grad_enabled():
        return None
    leaves, spec = tree_flatten(output)
    positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return None
    wrapped = _GatherBeforeBackward.apply(coordinator, module, *(leaves[i] for i in positions))
    for i, t in zip(positions, wrapped):
        leaves[i] = t
    return tree_unflatten(leaves, spec)

