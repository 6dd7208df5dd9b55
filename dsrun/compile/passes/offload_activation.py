"""DeepCompile's activation offload (DeepSpeed's ``passes.offload_activation``; ``compile.offload_activation``).

The forward graph's saved values (what the partitioner hands the backward after the caller's outputs) wait in
memory from their last forward use to their first backward use. The pass copies each out to a host buffer right
after its last forward use (``dc.offload_tensor``, then ``dc.wait_offload``, which the graph's output then
returns instead of the value: the value goes with its last reference) and back just before the backward reads it
(``dc.reload_tensor`` started as early as the backward's profile and the copy's time allow, ``dc.wait_reload``
right before the reader). Two halves, scheduled by ``init_z3``:

* ``offload_activation_floor`` (from step 0): moves every eligible value, and reloads each in the backward, so it
  runs correctly on its own and the next profile measures the floor;
* ``offload_activation`` (from ``WARMUP``, after the floor): brings values back to the device, largest first,
  while the budget (the accelerator's memory less a margin read from the allocator, clamped to
  ``MIN_MEASURED_MARGIN``..``MAX_MEASURED_MARGIN``; ``DS_DC_OFFLOAD_ACT_BUDGET_GB`` overrides it; the smallest
  over the ranks) exceeds the floor (the larger of the profile's and what the allocator reached; the largest over
  the ranks), and drops their reloads in the backward.

Eligible: a saved floating-point value the caller does not also receive, saved once, not a parameter nor a view
(a view frees nothing), of a static shape (a host buffer is kept per value and reused each step), at least
``MIN_OFFLOAD_SIZE`` bytes (``DS_DC_OFFLOAD_ACT_MIN_SIZE_MB``), and not on the host while the graph computes
elsewhere (small index and mask tensors). Host buffers are pinned on CUDA (``compile.offload_activation_pin_memory``,
through the accelerator's ``pin_memory``); a CPU's stay plain, as page-locking speeds only host-to-device copies. On a CPU the host buffer is a second buffer in the same memory: the
values the backward receives are the host copies and the training-time tensors go after their forward use, as on
CUDA, but the process's memory does not drop. dsrun copies on the compute stream: the waits end each copy.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import torch
from torch.fx import Graph, GraphModule, Node

from dsrun import comm as dist  # DeepSpeed's module name (its tests patch it)
from dsrun.accelerator import Accelerator, get_accelerator
from dsrun.compile.ops import GATHERS
from dsrun.compile.graph_param import DSGraphParamManager
from dsrun.compile.profilers import ProfilingResult
from dsrun.compile.passes.contract import PassContract
from dsrun.compile.util import get_no_copy_ops, print_rank_0, reduce_over_ranks

if TYPE_CHECKING:
    from dsrun.config.misc import CompileConfig

NAME = "offload_activation"
FLOOR_NAME = "offload_activation_floor"
CONTRACT = PassContract()  # reads and rewrites nothing the other passes make

MARGIN = 0.1  # the margin where the allocator cannot be read
MIN_MEASURED_MARGIN = 0.1
MAX_MEASURED_MARGIN = 0.25
MIN_OFFLOAD_SIZE = 5 * 1024 * 1024  # below it a copy costs more than the memory it returns
DEFAULT_H2D_BYTES_PER_SEC = 10e9

_ACTIVATION_OFFLOAD_OPS = ("offload_tensor", "wait_offload", "reload_tensor", "wait_reload")
_activation_ops_lib = None
_offload_plans: dict[int, "OrderedDict[str, tuple[int, int]]"] = {}  # graph id -> value name -> (value id, bytes)
_next_value_id = 0
_h2d_bytes_per_sec: float | None = None
_host_buffers: dict[tuple[int, int], torch.Tensor] = {}  # (graph id, value id) -> its host buffer
pin_memory = True  # compile.offload_activation_pin_memory
# offload/reload nodes ever built, and how many values the last plan left on the host
_stats = {"offload_nodes": 0, "reload_nodes": 0, "planned_offloads": 0}


def get_offload_activation_stats() -> dict[str, int]:
    return dict(_stats)


def reset_offload_activation_stats() -> None:
    for key in _stats:
        _stats[key] = 0


# --- the ops --------------------------------------------------------------------------------------------------
def _host_buffer(tensor: torch.Tensor, graph_id: int, value_id: int) -> torch.Tensor:
    buffer = _host_buffers.get((graph_id, value_id))
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        if pin_memory and get_accelerator().pin_memory_enabled():  # page-locking speeds host-to-device copies
            buffer = get_accelerator().pin_memory(buffer)
        _host_buffers[(graph_id, value_id)] = buffer
    return buffer


def _offload_tensor(tensor: torch.Tensor, graph_id: int, value_id: int) -> torch.Tensor:
    return _host_buffer(tensor, graph_id, value_id).copy_(tensor)


def _reload_tensor(host: torch.Tensor, graph_id: int, value_id: int) -> torch.Tensor:
    return host.to(get_accelerator().current_device_name(), copy=True)


def _wait(tensor: torch.Tensor, graph_id: int, value_id: int) -> torch.Tensor:
    get_accelerator().synchronize()  # the copies run on the compute stream: nothing else to wait for
    return tensor


def configure(compile_config: CompileConfig) -> None:
    """The ``compile`` section's settings for this pass (``offload_activation_pin_memory``)."""
    global pin_memory
    pin_memory = bool(getattr(compile_config, "offload_activation_pin_memory", True))


def register_activation_offload_ops() -> None:
    """The four ops in DeepSpeed's ``dc`` namespace, with a Meta kernel each, once. An op another library defined
    already (DeepSpeed's extension, or a test's schema-only stub of ``dc``) is not defined again: only the kernels it
    lacks are added."""
    global _activation_ops_lib
    if _activation_ops_lib is not None:
        return
    lib = torch.library.Library("dc", "FRAGMENT")
    for name, impl in zip(_ACTIVATION_OFFLOAD_OPS, (_offload_tensor, _wait, _reload_tensor, _wait)):
        try:
            alias = "(a)" if name.startswith("wait_") else ""  # a wait hands its input on
            lib.define(f"{name}(Tensor{alias} tensor, int graph_id, int value_id) -> Tensor{alias}")
        except RuntimeError as defined:  # the schema is there already: only its missing kernels are added below
            if "multiple times" not in str(defined):
                raise
        for key, kernel in (("CompositeExplicitAutograd", impl),
                            ("Meta", lambda tensor, graph_id, value_id: torch.empty_like(tensor))):
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dc::{name}", key):
                lib.impl(name, kernel, key)
    _activation_ops_lib = lib


def _new_value_id() -> int:
    global _next_value_id
    _next_value_id += 1
    return _next_value_id


# --- the budget -----------------------------------------------------------------------------------------------
def _get_mem_usage_out_of_torch() -> int:
    """Device memory used outside torch's allocator (CUDA's used less torch's reserved; 0 on a CPU)."""
    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return max(0, total - free - torch.cuda.memory_reserved())


def _memory_reserved(accelerator: Accelerator) -> int:
    reserved = getattr(accelerator, "memory_reserved", None)
    if reserved is not None:
        return reserved()
    return torch.cuda.memory_reserved() if torch.cuda.is_available() else accelerator.memory_allocated()


def _measured_margin(accelerator: Accelerator) -> float:
    """The share of the device the allocator holds unused, clamped (``DS_DC_OFFLOAD_ACT_MARGIN`` overrides)."""
    override = os.environ.get("DS_DC_OFFLOAD_ACT_MARGIN")
    if override is not None:
        return float(override)
    total = accelerator.total_memory()
    if not total:
        return MARGIN
    slack = max(0, _memory_reserved(accelerator) - accelerator.memory_allocated()) / total
    return min(max(slack, MIN_MEASURED_MARGIN), MAX_MEASURED_MARGIN)


def _memory_budget() -> float:
    override = os.environ.get("DS_DC_OFFLOAD_ACT_BUDGET_GB")
    if override is not None:
        return float(override) * 1e9
    accelerator = get_accelerator()
    return reduce_over_ranks([accelerator.total_memory() * (1 - _measured_margin(accelerator))], "MIN", dist=dist,
                             accelerator=accelerator)[0]


def _agree_on_floor_peak(floor_peak: int) -> float:
    """The busiest rank's floor: every rank must make the same plan."""
    return reduce_over_ranks([floor_peak], "MAX", dist=dist, accelerator=get_accelerator())[0]


def _min_offload_size() -> int:
    override = os.environ.get("DS_DC_OFFLOAD_ACT_MIN_SIZE_MB")
    return int(float(override) * 1024 * 1024) if override is not None else MIN_OFFLOAD_SIZE


def _h2d_bandwidth() -> float:
    """Host-to-device bytes per second, measured once (how far ahead of its reader a reload starts)."""
    global _h2d_bytes_per_sec
    if _h2d_bytes_per_sec is None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        accelerator, size = get_accelerator(), 32 * 1024 * 1024
        _h2d_bytes_per_sec = DEFAULT_H2D_BYTES_PER_SEC
        with unset_fake_temporarily():
            host = accelerator.pin_memory(torch.empty(size, dtype=torch.uint8))
            target = torch.empty(size, dtype=torch.uint8, device=accelerator.current_device_name())
            target.copy_(host)
            accelerator.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                target.copy_(host, non_blocking=True)
            accelerator.synchronize()
            elapsed = time.perf_counter() - start
        if elapsed > 0:
            _h2d_bytes_per_sec = size * 5 / elapsed
    return _h2d_bytes_per_sec


# --- the forward: what moves ------------------------------------------------------------------------------
def _output_node(graph: Graph) -> Node:
    return next(node for node in reversed(graph.nodes) if node.op == "output")


def _copy_meta(src: Node, dst: Node) -> None:
    for key in ("val", "tensor_meta"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def _eligible_activations(graph: Graph, graph_id: int, num_fwd_outputs: int | None,
                          param_manager: dict[int, DSGraphParamManager]) -> list[tuple[Node, int]]:
    """The saved values this pass may move, largest first (the module's docstring says which)."""
    outputs = _output_node(graph).args[0]
    if num_fwd_outputs is None or not isinstance(outputs, (list, tuple)):
        print_rank_0(f"offload_activation graph {graph_id}: no partition information; nothing moved")
        return []
    to_caller = {n for n in outputs[:num_fwd_outputs] if isinstance(n, Node)}
    saved = [n for n in outputs[num_fwd_outputs:] if isinstance(n, Node)]
    params = set(param_manager[graph_id].param_names) if graph_id in param_manager else set()
    values = [n.meta.get("val") for n in saved]
    elsewhere = any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values)
    no_copy, min_size = get_no_copy_ops(), _min_offload_size()
    candidates = []
    for node in dict.fromkeys(saved):
        val = node.meta.get("val")
        if saved.count(node) > 1 or node in to_caller or node.name in params or node.target in no_copy \
                or any(user.target in GATHERS for user in node.users):  # a ZeRO-3 parameter's placeholder
            continue
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if (elsewhere and val.device.type == "cpu") or any(not isinstance(d, int) for d in val.shape):
            continue
        size = val.numel() * val.element_size()
        if size >= min_size:
            candidates.append((node, size))
    candidates.sort(key=lambda candidate: candidate[1], reverse=True)
    return candidates


def _after_last_use(graph: Graph, node: Node) -> Node:
    """The node to put the copy before: the first after ``node``'s last forward reader (not the output)."""
    nodes = list(graph.nodes)
    last = max([nodes.index(node)] + [nodes.index(u) for u in node.users if u.op != "output"])
    at = last + 1
    while nodes[at].op == "placeholder":
        at += 1
    return nodes[at]


def _offload_everything_fwd(gm: GraphModule, graph_id: int, profiling_results: dict[int, ProfilingResult],
                            param_manager: dict[int, DSGraphParamManager]) -> GraphModule | None:
    graph = gm.graph
    _offload_plans[graph_id] = OrderedDict()  # a compile phase plans again from the uncompiled graph
    selected = _eligible_activations(graph, graph_id, profiling_results[graph_id].num_fwd_outputs, param_manager)
    if not selected:
        return None
    output = _output_node(graph)
    for node, size in selected:
        value_id = _new_value_id()
        with graph.inserting_before(_after_last_use(graph, node)):
            copy = graph.create_node("call_function", torch.ops.dc.offload_tensor.default, (node, graph_id, value_id),
                                     {}, name=f"offload_{node.name}")
        _copy_meta(node, copy)
        with graph.inserting_after(copy):  # the copy ends here: the value's buffer may be reused after it
            wait = graph.create_node("call_function", torch.ops.dc.wait_offload.default, (copy, graph_id, value_id),
                                     {}, name=f"wait_offload_{node.name}")
        _copy_meta(node, wait)
        output.replace_input_with(node, wait)
        _offload_plans[graph_id][node.name] = (value_id, size)
        _stats["offload_nodes"] += 1
    graph.lint()
    print_rank_0(f"offload_activation graph {graph_id}: floor moves {len(selected)} activations "
                 f"({sum(size for _, size in selected)} bytes)")
    return gm


def _unlink(graph: Graph, name: str, copy_prefix: str, wait_prefix: str) -> None:
    """Erase a value's copy and wait nodes; their readers read the value itself again."""
    by_name = {node.name: node for node in graph.nodes}
    value, copy, wait = by_name.get(name), by_name.get(copy_prefix + name), by_name.get(wait_prefix + name)
    if value is None or copy is None or wait is None:
        return
    for user in list(wait.users):
        user.replace_input_with(wait, value)
    graph.erase_node(wait)
    graph.erase_node(copy)


def _plan_against_floor_fwd(gm: GraphModule, graph_id: int, profiling_results: dict[int, ProfilingResult]) -> None:
    plan = _offload_plans.get(graph_id)
    if not plan:
        return None
    profile = profiling_results[graph_id]
    if not profile.fwd_mem:  # not even the floor could be profiled: everything stays on the host
        return None
    profiled = _agree_on_floor_peak(max(peak for _, _, _, peak in profile.fwd_mem))
    observed = _agree_on_floor_peak(get_accelerator().max_memory_allocated() + _get_mem_usage_out_of_torch())
    headroom = _memory_budget() - (observed if observed > 0 else profiled)
    for name, (_, size) in sorted(plan.items(), key=lambda item: item[1][1], reverse=True):
        if size <= headroom:
            _unlink(gm.graph, name, "offload_", "wait_offload_")
            del plan[name]
            headroom -= size
            _stats["offload_nodes"] -= 1
    _stats["planned_offloads"] = len(plan)
    print_rank_0(f"offload_activation graph {graph_id}: {len(plan)} activations stay on the host")
    gm.graph.lint()
    gm.recompile()
    return None  # rewritten in place


# --- the backward: what comes back, and when ------------------------------------------------------------------
def _reload_activation_bwd(gm: GraphModule, graph_id: int, profiling_results: dict[int, ProfilingResult]) -> None:
    plan = _offload_plans.get(graph_id)
    if not plan:
        return None
    graph, profile = gm.graph, profiling_results[graph_id]
    node_ms = {name: ms for name, ms, _ in getattr(profile, "bwd_time", [])}
    peaks = {name: peak for name, _, _, peak in profile.bwd_mem}
    budget, bandwidth = _memory_budget(), _h2d_bandwidth()
    just_in_time = not profile.bwd_mem  # no profile: no evidence that an earlier start fits
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    placeholders = {node.name: node for node in nodes if node.op == "placeholder"}
    targets = []
    for name, (value_id, size) in plan.items():
        node = placeholders.get(name)
        readers = [u for u in node.users if u.op != "output"] if node is not None else []
        if readers:
            first = min(readers, key=index.__getitem__)
            targets.append((index[first], node, first, value_id, size))
    reloaded = 0
    for first_index, node, first, value_id, size in sorted(targets, key=lambda t: t[0]):
        copy_ms, elapsed, start = size / bandwidth * 1000, 0.0, first
        for candidate in ([] if just_in_time else reversed(nodes[:first_index])):
            if candidate.op == "placeholder" or peaks.get(candidate.name, 0) + reloaded + size > budget:
                break
            elapsed += node_ms.get(candidate.name, 0.0)
            start = candidate
            if elapsed >= copy_ms:
                break
        with graph.inserting_before(start):
            copy = graph.create_node("call_function", torch.ops.dc.reload_tensor.default, (node, graph_id, value_id),
                                     {}, name=f"reload_{node.name}")
        _copy_meta(node, copy)
        with graph.inserting_before(first):
            wait = graph.create_node("call_function", torch.ops.dc.wait_reload.default, (copy, graph_id, value_id),
                                     {}, name=f"wait_reload_{node.name}")
        _copy_meta(node, wait)
        for user in list(node.users):
            if user is not copy:
                user.replace_input_with(node, wait)
        reloaded += size
        _stats["reload_nodes"] += 1
    if targets:
        graph.lint()
        gm.recompile()
    return None


def _drop_reloads_for_resident_bwd(gm: GraphModule, graph_id: int) -> None:
    plan = _offload_plans.get(graph_id) or {}
    dropped = [n.name[len("wait_reload_"):] for n in gm.graph.nodes if n.name.startswith("wait_reload_")]
    dropped = [name for name in dropped if name not in plan]
    for name in dropped:
        _unlink(gm.graph, name, "reload_", "wait_reload_")
        _stats["reload_nodes"] -= 1
    if dropped:
        gm.graph.lint()
        gm.recompile()


def offload_activation_floor(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]],
                             profiling_results: dict[int, ProfilingResult], create_inputs_fn: Callable[[], tuple] | None, mem_budget: float, param_manager: dict[int, DSGraphParamManager],
                             bwd: bool) -> GraphModule | None:
    """Every eligible value out in the forward, each back in the backward (runs correctly on its own)."""
    register_activation_offload_ops()
    if bwd:
        return _reload_activation_bwd(gm, graph_id, profiling_results)
    return _offload_everything_fwd(gm, graph_id, profiling_results, param_manager)


def offload_activation(gm: GraphModule, graph_id: int, graph_order: list[tuple[int, bool]], profiling_results: dict[int, ProfilingResult],
                       create_inputs_fn: Callable[[], tuple] | None, mem_budget: float, param_manager: dict[int, DSGraphParamManager], bwd: bool) -> None:
    """After the floor: keep on the device what the budget has room for; the backward drops their reloads."""
    register_activation_offload_ops()
    if bwd:
        _drop_reloads_for_resident_bwd(gm, graph_id)
        return None
    return _plan_against_floor_fwd(gm, graph_id, profiling_results)
