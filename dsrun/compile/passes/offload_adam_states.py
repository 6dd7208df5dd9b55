"""DeepCompile's optimizer-state offload (DeepSpeed's ``passes.offload_adam_states``; ``compile.offload_opt_states``).

Between two optimizer steps the forward and backward need none of the optimizer's own state: Adam's moments
(``exp_avg``, ``exp_avg_sq``) and the fp32 master partition (``hp_param``). The pass moves each of them to a host
buffer at the start of the first forward graph and brings it back in the backward graphs, before the step reads
it, keeping resident whatever the memory budget (the accelerator's memory less ``MARGIN``;
``DS_DC_OFFLOAD_OPT_BUDGET_GB`` overrides it) leaves room for above the profiled peak of each node:

* ``move_opt_states`` (``offload_adam_states``): at the first forward graph every state is listed as a task; the
  tasks that do not fit are launched (``dc.offload_opt_launch``) before the graph's first node. In the backward,
  each still-offloaded state is reloaded (``dc.reload_opt``) as soon as the running peak leaves room for it, the
  rest before the last backward graph's output, then ``dc.reload_copy_stream_sync``; ``dc.opt_empty_cache`` at
  the head of the first backward graph gives the freed memory back once per compile phase.
* ``offload_adam_states_for_init``: moves every state out before the profile (the plan is made on the floor).
* ``move_opt_states_sync`` (``offload_adam_states_sync``): everything out at the head of the first forward graph,
  back before the last backward graph's output, without a plan.

The ops carry an index into a task registry (the tensors never cross the op boundary), are side-effectful for
FX's dead-code elimination and ORDERED effects for inductor's. What moves is dsrun's stage-3 strategy's (an
:class:`ZeroOptimizerStates` view: the torch optimizer's state per sub-group master, the masters and their host
buffers): a master moves with its views (``ds_fp32_shard``), every reference stays valid; a master the model's
shards alias (fp32 training: the shards are views of it) stays, as the forward gathers from it. dsrun copies on
the compute stream (no side stream): on CUDA the copies do not overlap the graph; on a CPU the host buffer is a
second buffer in the same memory, so the states' training-time tensors are gone between the forward's start and
the backward's reload (what the pass does) while the process's total memory does not drop.
"""
from __future__ import annotations

import copy
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.fx import Graph, GraphModule

from dsrun import comm as dist
from dsrun.accelerator import get_accelerator
from dsrun.compile.graph_param import DSGraphParamManager
from dsrun.compile.profilers import ProfilingResult
from dsrun.compile.passes.contract import CAP_OPT_STATES_EVICTED, PassContract
from dsrun.offload.state_moves import StateTensor, move_storage
from dsrun.zero.offload_states import _make_offload_state_key

try:
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
except ImportError:  # a torch without the effects registry: FX's side-effect mark alone
    _register_effectful_op = None

if TYPE_CHECKING:
    from dsrun.compile.handle import DeepCompileHandle
    from dsrun.zero.stage3 import Stage3Strategy

NAME = "offload_adam_states"
NAME_SYNC = "offload_adam_states_sync"
NAME_FOR_INIT = "offload_adam_states_for_init"
# the states these passes move exist only at ZeRO-3 (init_z3 sets them up), and one offload target per run
_INCOMPATIBLE = frozenset({"offload_parameters", "zero1_compile", "zero2_compile"})
CONTRACT = PassContract(requires=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)
CONTRACT_SYNC = PassContract(conflicts_with=_INCOMPATIBLE | {NAME})
CONTRACT_FOR_INIT = PassContract(provides=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_INCOMPATIBLE)

MARGIN = 0.2  # DeepSpeed's: the share of the accelerator's memory the plan leaves free
MOMENTS = ("exp_avg", "exp_avg_sq")

optimizer: Any = None  # the states moved (DeepSpeed's shape: .state, .fp32_partitioned_groups_flat, pin buffers)
device: torch.device | None = None
nz3: Any = None  # the DeepCompile handle


class ZeroOptimizerStates:
    """DeepSpeed's ZeRO-3 optimizer as this pass reads it, over dsrun's stage-3 strategy: ``state`` (the torch
    optimizer's state dict of each sub-group master, in order), ``fp32_partitioned_groups_flat`` (the masters)
    and ``hp_params_pin_buffers`` (a host buffer per master, None for a master the shards alias)."""

    def __init__(self, strategy: Stage3Strategy) -> None:
        from dsrun.offload.state_moves import OffloadStateTypeEnum

        self.masters: list[StateTensor] = [item for item in strategy.state_tensors(OffloadStateTypeEnum.hp_params)
                                           if item.tensor.device.type != "meta"]
        self._optimizer = strategy.placement.stores[0].optimizer if strategy.placement.stores else None
        self.fp32_partitioned_groups_flat = [item.tensor for item in self.masters]
        lp = {p.ds_tensor.untyped_storage().data_ptr() for p in strategy.params}
        pin = get_accelerator().pin_memory
        self.hp_params_pin_buffers = [
            None if item.tensor.untyped_storage().data_ptr() in lp
            else pin(torch.empty_like(item.tensor, device="cpu")) for item in self.masters]

    @property
    def state(self) -> "OrderedDict[torch.Tensor, dict]":
        return OrderedDict((item.tensor, self._optimizer.state[item.tensor]) for item in self.masters)

    def views_of(self, master: torch.Tensor) -> list[torch.Tensor]:
        return next((item.views for item in self.masters if item.tensor is master), [])


def print_r0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message)


def _profiling() -> bool:
    return nz3 is not None and bool(getattr(nz3, "is_profiling", lambda: False)())


def _unfaked():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# --- moving one state -----------------------------------------------------------------------------------
def move_key(state: dict, key: str) -> None:
    """``state[key]`` into its host buffer (made once, kept), and dropped from the state."""
    if key not in state:
        return
    host_key = _make_offload_state_key(key)
    if host_key not in state:
        state[host_key] = get_accelerator().pin_memory(torch.empty_like(state[key], device="cpu"))
    state[host_key].copy_(state[key])
    del state[key]


def move_back_key(state: dict, key: str) -> None:
    """A fresh ``state[key]`` on the training device, from its host buffer."""
    host = state[_make_offload_state_key(key)]
    state[key] = host.to(device if device is not None else host.device, copy=True)


def move_hp_param(master: torch.Tensor, host_buffer: torch.Tensor) -> None:
    """The master into its host buffer, its views (``ds_fp32_shard``) re-pointed with it."""
    if master.untyped_storage().data_ptr() != host_buffer.untyped_storage().data_ptr():
        move_storage(StateTensor(master, _views(master)), host_buffer)


def move_back_hp_param(master: torch.Tensor, host_buffer: torch.Tensor) -> None:
    """The master back in a fresh buffer on the training device, with its views."""
    home = device if device is not None else host_buffer.device
    move_storage(StateTensor(master, _views(master)), torch.empty_like(host_buffer, device=home))


def _views(master: torch.Tensor) -> list[torch.Tensor]:
    views_of = getattr(optimizer, "views_of", None)
    return views_of(master) if views_of is not None else []


def _hp_pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(m, b) for m, b in zip(optimizer.fp32_partitioned_groups_flat, optimizer.hp_params_pin_buffers)
            if b is not None]


def offload_adam_states_sync() -> None:
    with _unfaked():
        for state in optimizer.state.values():
            for key in MOMENTS:
                move_key(state, key)
        for master, host_buffer in _hp_pairs():
            move_hp_param(master, host_buffer)
        get_accelerator().synchronize()


def reload_adam_states_sync() -> None:
    with _unfaked():
        for state in optimizer.state.values():
            for key in MOMENTS:
                if _make_offload_state_key(key) in state and key not in state:
                    move_back_key(state, key)
        for master, host_buffer in _hp_pairs():
            if master.untyped_storage().data_ptr() == host_buffer.untyped_storage().data_ptr():
                move_back_hp_param(master, host_buffer)
        get_accelerator().synchronize()


def sync_offload_states() -> None:
    if _profiling():
        offload_adam_states_sync()
    else:
        get_accelerator().synchronize()


def sync_reload_states() -> None:
    if _profiling():
        reload_adam_states_sync()
    else:
        get_accelerator().synchronize()


# --- the graph ops ----------------------------------------------------------------------------------------
_op_task_registry: list[tuple] = []  # (index, key or (master, host buffer), state name, bytes, dtype)
_offload_ops_lib = None
_offload_op_stats = {"launches": 0, "reloads": 0}  # ops run (reloads never while profiling)
_empty_cache_pending = False  # armed by each backward rewrite, cleared by the first empty_cache that runs


def get_offload_op_stats() -> dict[str, int]:
    return dict(_offload_op_stats)


def reset_offload_op_stats() -> None:
    for key in _offload_op_stats:
        _offload_op_stats[key] = 0


def _register_op_task(task: tuple) -> int:
    _op_task_registry.append(task)
    return len(_op_task_registry) - 1


def _offload_opt_launch_impl(anchor: torch.Tensor, idx: int) -> None:
    _offload_op_stats["launches"] += 1
    _, target, key, _, _ = _op_task_registry[idx]
    if key == "hp_param":
        move_hp_param(*target)
    else:
        move_key(optimizer.state[target], key)


def _reload_opt_impl(anchor: torch.Tensor, idx: int) -> None:
    if _profiling():
        return
    _offload_op_stats["reloads"] += 1
    _, target, key, _, _ = _op_task_registry[idx]
    if key == "hp_param":
        move_back_hp_param(*target)
    else:
        move_back_key(optimizer.state[target], key)


def _opt_empty_cache_impl(anchor: torch.Tensor) -> None:
    global _empty_cache_pending
    if _empty_cache_pending:  # once per compile phase returns the freed segments; each step would cost time
        _empty_cache_pending = False
        get_accelerator().empty_cache()


def _reload_copy_stream_sync_impl(anchor: torch.Tensor) -> None:
    get_accelerator().synchronize()  # the step reads the reloaded states as soon as the graph returns


_OFFLOAD_OP_SPECS = [
    ("offload_opt_launch", "offload_opt_launch(Tensor anchor, int idx) -> ()", _offload_opt_launch_impl),
    ("reload_opt", "reload_opt(Tensor anchor, int idx) -> ()", _reload_opt_impl),
    ("opt_empty_cache", "opt_empty_cache(Tensor anchor) -> ()", _opt_empty_cache_impl),
    ("reload_copy_stream_sync", "reload_copy_stream_sync(Tensor anchor) -> ()", _reload_copy_stream_sync_impl),
]


def register_offload_ops() -> None:
    """The four ops in DeepSpeed's ``dc`` namespace (a fragment: another library may own it), once."""
    global _offload_ops_lib
    if _offload_ops_lib is not None:
        return
    lib = torch.library.Library("dc", "FRAGMENT")
    for name, schema, impl in _OFFLOAD_OP_SPECS:
        lib.define(schema)
        lib.impl(name, impl, "CompositeExplicitAutograd")
        lib.impl(name, lambda *args: None, "Meta")
    for name, _, _ in _OFFLOAD_OP_SPECS:  # nothing reads their output: kept by both dead-code eliminations
        overload = getattr(torch.ops.dc, name).default
        torch.fx.node._side_effectful_functions.add(overload)
        if _register_effectful_op is not None:
            _register_effectful_op(overload, _EffectType.ORDERED)
    _offload_ops_lib = lib  # the ops go if the library object is collected


def _find_graph_anchor(graph: Graph) -> torch.fx.Node:
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            return node
    raise AssertionError("no tensor placeholder to anchor the optimizer-state offload ops on")


# --- the plan ----------------------------------------------------------------------------------------------
offload_tasks: list[tuple] = []  # listed at the first forward graph, not yet scheduled
offload_tasks_scheduled: list[tuple] = []
offload_tasks_inserted = 0  # of the scheduled tasks, those that have launch nodes (one graph per break)
reload_tasks_remaining: list[tuple] = []
total_reload_mem = 0


def _budget() -> float:
    override = os.environ.get("DS_DC_OFFLOAD_OPT_BUDGET_GB")
    return float(override) * 1e9 if override is not None else get_accelerator().total_memory() * (1 - MARGIN)


def _running_peaks(graph: Graph, records: list, bwd: bool) -> dict[str, int]:
    """Each node's peak so far, in execution order (the backward's counted from its end, as DeepSpeed's)."""
    by_name = {name: peak for name, _, _, peak in records}
    peaks, running = {}, 0
    for node in (reversed(graph.nodes) if bwd else graph.nodes):
        running = max(running, by_name.get(node.name, 0))
        peaks[node.name] = running
    return peaks


def _list_tasks() -> None:
    """Every state as a task (its host buffer made by one round trip): moments, then the master, per group."""
    offload_adam_states_sync()
    reload_adam_states_sync()
    sync_reload_states()
    pins = list(optimizer.hp_params_pin_buffers)
    for i, (key, state) in enumerate(optimizer.state.items()):
        for name in MOMENTS:
            host = state.get(_make_offload_state_key(name))
            if host is not None:
                offload_tasks.append((i, key, name, host.numel() * host.element_size(), host.dtype))
        if i < len(optimizer.fp32_partitioned_groups_flat) and i < len(pins) and pins[i] is not None:
            master = optimizer.fp32_partitioned_groups_flat[i]
            offload_tasks.append((i, (master, pins[i]), "hp_param", master.numel() * master.element_size(),
                                  master.dtype))


def offload_opt_states_inc(graph: Graph, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: dict[int, ProfilingResult],
                           mem_budget: float, param_manager: dict[int, DSGraphParamManager], bwd: bool) -> Graph:
    """Insert the launches (forward) or the reloads (backward) of the states the budget cannot keep."""
    global _empty_cache_pending, offload_tasks_inserted, reload_tasks_remaining, total_reload_mem
    register_offload_ops()
    anchor = _find_graph_anchor(graph)
    total_mem = _budget()
    result = profiling_results[graph_id]
    peaks = _running_peaks(graph, result.bwd_mem if bwd else result.fwd_mem, bwd)
    if not bwd:
        if graph_id == graph_order[0][0]:  # the first forward graph: a fresh plan for this compile phase
            offload_tasks.clear()
            offload_tasks_scheduled.clear()
            _op_task_registry.clear()
            offload_tasks_inserted, total_reload_mem = 0, 0
            with _unfaked():
                _list_tasks()
        for node in graph.nodes:
            if node.name not in peaks or node.op == "placeholder" or node.name.startswith("offload_opt_"):
                continue
            # the profile was taken with the states out: keeping them resident adds to each node's peak
            while offload_tasks and total_mem - peaks[node.name] - sum(t[3] for t in offload_tasks) < 0:
                task = offload_tasks.pop(0)
                print_r0(f"offload_opt_states: scheduling the offload of {task[0]}_{task[2]}")
                offload_tasks_scheduled.append(task)
        first = next((n for n in graph.nodes if n.op != "placeholder"), None)
        for task in offload_tasks_scheduled[offload_tasks_inserted:]:
            with graph.inserting_before(first):
                graph.create_node("call_function", torch.ops.dc.offload_opt_launch.default,
                                  (anchor, _register_op_task(task)), {}, name=f"offload_opt_{task[0]}_{task[2]}")
        offload_tasks_inserted = len(offload_tasks_scheduled)
        return graph
    backward_order = [g for g, needs_backward in graph_order if needs_backward]
    first_bwd, last_bwd = graph_id == backward_order[-1], graph_id == backward_order[0]
    if first_bwd:
        _empty_cache_pending = True
        head = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(head):
            graph.create_node("call_function", torch.ops.dc.opt_empty_cache.default, (anchor,), {},
                              name="empty_cache")
        reload_tasks_remaining = copy.copy(offload_tasks_scheduled)
    for node in list(graph.nodes):
        if node.name not in peaks or node.op in ("placeholder", "output"):
            continue
        at = node
        while reload_tasks_remaining and total_mem > peaks[node.name] + total_reload_mem + reload_tasks_remaining[0][3]:
            task = reload_tasks_remaining.pop(0)
            with graph.inserting_after(at):
                at = graph.create_node("call_function", torch.ops.dc.reload_opt.default,
                                       (anchor, _register_op_task(task)), {}, name=f"reload_opt_{task[0]}_{task[2]}")
            total_reload_mem += task[3]
    if last_bwd:
        output = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(output):
            for task in reload_tasks_remaining:
                graph.create_node("call_function", torch.ops.dc.reload_opt.default, (anchor, _register_op_task(task)),
                                  {}, name=f"reload_opt_{task[0]}_{task[2]}")
            graph.create_node("call_function", torch.ops.dc.reload_copy_stream_sync.default, (anchor,), {},
                              name="reload_copy_stream_sync")
        reload_tasks_remaining = []
    return graph


def move_opt_states(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: dict[int, ProfilingResult],
                    create_inputs_fn: Callable[[], tuple] | None, mem_budget: float, param_manager: dict[int, DSGraphParamManager], bwd: bool) -> GraphModule:
    offload_opt_states_inc(gm.graph, graph_id, graph_order, profiling_results, mem_budget, param_manager, bwd)
    return gm


def move_opt_states_sync(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: dict[int, ProfilingResult],
                         create_inputs_fn: Callable[[], tuple] | None, mem_budget: float, param_manager: dict[int, DSGraphParamManager], bwd: bool) -> GraphModule:
    """Everything out at the head of the first forward graph, back before the last backward graph's output."""
    graph = gm.graph
    if bwd and graph_id == [g for g, needs_backward in graph_order if needs_backward][0]:
        with graph.inserting_before(next(n for n in graph.nodes if n.op == "output")):
            graph.create_node("call_function", reload_adam_states_sync, (), {}, name="reload_opt")
    elif not bwd and graph_id == graph_order[0][0]:
        with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
            graph.create_node("call_function", offload_adam_states_sync, (), {}, name="offload_opt")
    return gm


def offload_adam_states_for_init(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]],
                                 profiling_results: dict[int, ProfilingResult], create_inputs_fn: Callable[[], tuple] | None, mem_budget: float, param_manager: dict[int, DSGraphParamManager],
                                 bwd: bool) -> None:
    """Every state out before the first forward graph is profiled (None: the graph is not changed)."""
    if not bwd and graph_id == graph_order[0][0]:
        with _unfaked():
            offload_adam_states_sync()


def init_offload_opt_states(adam_optimizer: ZeroOptimizerStates, handle: DeepCompileHandle) -> None:
    """The states these passes move (a :class:`ZeroOptimizerStates`, or DeepSpeed's optimizer) and the handle."""
    global optimizer, device, nz3
    register_offload_ops()
    optimizer, nz3 = adam_optimizer, handle
    device = torch.device(get_accelerator().current_device_name())


torch.fx.node._side_effectful_functions.update({offload_adam_states_sync, reload_adam_states_sync})
