"""A graph's memory and time, per node.

dsrun's passes plan from :func:`memory_records`: the shapes the compiler already knows (``node.meta["val"]``)
give the bytes each node holds with no extra run: each node's output is allocated when it runs and freed after its
last reader; a view allocates nothing; gathered parameters count at full size, which is what the selective-gather
budget needs. Its times are 0 (nothing is run).

DeepSpeed measures instead, running the graph on real inputs; its two interpreters are here for a pass that wants
measured figures (:class:`ProfilingInterpreter`: each node's device and wall time and memory, warm-up runs left
out of the timings; :class:`MemoryProfilingInterpreter`: the memory after each node). Both run with the handle in
profiling mode (no gradient is reduced), clear what a failed run left gathered, and on a failure every rank stops
together: a node that raises still takes part in the node's collectives and then in a vote
(:func:`_abort_if_any_rank_failed`), so the other ranks are not left waiting in a collective it never reaches;
the profile is then marked incomplete and the passes leave the graph as it is. Figures are agreed with MAX over
the ranks (the slowest rank's time, the largest memory; gloo has no AVG).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.fx import Graph, GraphModule, Interpreter, Node
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_all, tree_leaves

from dsrun import comm as dist  # DeepSpeed's module name (its tests patch it)
from dsrun.accelerator import get_accelerator
from dsrun.compile.passes.graph_edit import _is_view, tensor_bytes
from dsrun.compile.util import ds_id_of, get_deepcompile_handle, is_allgather_node, is_comm_op, is_release_node


def memory_records(graph: Graph) -> list[tuple[str, int, int, int]]:
    """``(node name, resident bytes after the node, change, peak while it ran)`` for every node in order."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    frees: dict[int, list[Any]] = {}
    for node in graph.nodes:
        readers = [position[u] for u in node.users if u.op != "output"]
        if readers and not _is_view(node) and not any(u.op == "output" for u in node.users):
            frees.setdefault(max(readers), []).append(node)
    resident, records = 0, []
    for i, node in enumerate(graph.nodes):
        before = resident
        if not _is_view(node) and node.op in ("call_function", "call_module", "call_method"):
            resident += tensor_bytes(node)
        peak = resident
        for freed in frees.get(i, []):
            if freed.op != "placeholder":
                resident -= tensor_bytes(freed)
        records.append((node.name, resident, resident - before, peak))
    return records


# what a profiled node carries (DeepSpeed's keys): bytes of its output, resident and peak bytes after it, its
# time. dsrun's profile is from shapes and times nothing: the times are 0 (the list scheduler then orders by memory)
PROFILE_META_DEFAULTS = {"device_time": 0.0, "wall_time": 0.0, "tensor_size": 0, "alloc_mem": 0, "max_mem": 0}
INCOMPLETE = "profile_incomplete"


def annotate(graph: Graph, records: list[tuple[str, int, int, int]]) -> None:
    """Each node's profile keys from its :func:`memory_records` row; a node without a row is left without them
    (and the graph is then incomplete: :func:`_backfill_missing_profile_metadata`)."""
    by_name = {name: (resident, peak) for name, resident, _, peak in records}
    for node in graph.nodes:
        if node.name in by_name:
            node.meta["tensor_size"] = 0 if _is_view(node) else tensor_bytes(node)
            node.meta["alloc_mem"], node.meta["max_mem"] = by_name[node.name]
            node.meta.setdefault("device_time", 0.0)
            node.meta.setdefault("wall_time", 0.0)
    _backfill_missing_profile_metadata(graph, profile_complete=len(by_name) == len(graph.nodes))


def _backfill_missing_profile_metadata(graph: Graph, profile_complete: bool = True) -> None:
    """A profile that missed nodes (or ``profile_complete`` False) marks every node of the graph incomplete, then
    gives each missing key its default, so the planning passes can read any node and skip the graph."""
    if not profile_complete or any(key not in n.meta for n in graph.nodes for key in PROFILE_META_DEFAULTS):
        for node in graph.nodes:
            node.meta[INCOMPLETE] = True
    for node in graph.nodes:
        for key, default in PROFILE_META_DEFAULTS.items():
            node.meta.setdefault(key, default)


def is_profile_incomplete(graph: Graph | None) -> bool:
    """A graph some of whose nodes the profile did not reach (their ``meta["profile_incomplete"]``)."""
    return graph is not None and any(getattr(n, "meta", {}).get(INCOMPLETE) for n in graph.nodes)


class ProfileAborted(RuntimeError):
    """Profiling failed on some rank; raised on every rank at the same node."""


def _abort_if_any_rank_failed(error: BaseException | None, device: torch.device, distributed: bool = True) -> None:
    """Every rank says whether its node failed (a MAX of one flag), and all raise :class:`ProfileAborted` if one
    did: a rank that stopped alone would leave the others in a collective it never joins. Without a process group
    (or ``distributed=False``) a local ``error`` is raised as it is. A failure inside a collective itself is past
    helping: the others are already waiting in it."""
    if not distributed or not dist.is_initialized():
        if error is not None:
            raise ProfileAborted(str(error)) from error
        return
    with unset_fake_temporarily():
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, dist.ReduceOp.MAX)
    if error is not None:
        raise ProfileAborted(str(error)) from error
    if flag.item():
        raise ProfileAborted("profiling failed on another rank")


def _run_warmup_for_profile(call_fn: Callable[[], Any], warmup: int) -> None:
    """``warmup`` untimed runs; each output is dropped at once."""
    for _ in range(warmup):
        call_fn()


def _run_repeatedly_for_profile(call_fn: Callable[[], Any], iteration: int, start_events: Sequence[Any],
                                end_events: Sequence[Any]) -> Any:
    """``iteration`` timed runs between each pair of events (an accelerator without events gives None: not
    recorded); the last output is returned, each earlier one dropped before the next run allocates its own."""
    out = None
    for i in range(iteration):
        start, end = start_events[i], end_events[i]
        out = None
        if start is not None:
            start.record()
        out = call_fn()
        if end is not None:
            end.record()
    return out


def _all_real_if_tensor(args: object) -> bool:
    return tree_all(lambda x: not torch.is_tensor(x) or not is_fake(x), args)


def _to(value: object, device: torch.device) -> object:
    """``value`` on ``device``, but a pinned host tensor stays where it is: it is an offloaded value, and copying it
    back would undo the offload and hide the memory it freed from the profile."""
    if not torch.is_tensor(value):
        return value
    if value.device.type == "cpu" and value.is_pinned():
        return value
    with unset_fake_temporarily():
        return value.to(device)


def _node_size(out: object) -> int:
    return sum(v.element_size() * v.numel() for v in tree_leaves(out) if torch.is_tensor(v))


def _args_key(value: object) -> object:
    """What decides a node's cost: a tensor's dtype, device and shape (a one-element tensor's value too, which may
    be a size), anything else as it prints."""
    def key(v: object) -> str:
        if not torch.is_tensor(v):
            return str(v)
        if v.numel() == 1:
            try:
                return f"{v.dtype}{v.device}{v.item()}"
            except RuntimeError:
                return f"{v.dtype}{v.device}ptr{v.data_ptr()}"
        return f"{v.dtype}{v.device}{tuple(v.shape)}"
    return map_aggregate(value, key)


def _get_mem_usage_out_of_torch() -> int:
    """Device memory held outside torch's allocator (another process, a library), added to each node's reading:
    what NVML says is used less what torch has reserved; 0 where NVML is not there (a CPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(get_accelerator().current_device())
        return max(0, pynvml.nvmlDeviceGetMemoryInfo(handle).used - get_accelerator().memory_reserved())
    except Exception:  # noqa: BLE001 - no NVML, no device: nothing measured outside torch
        return 0


def _device() -> torch.device:
    """The accelerator's current device (an index where it gives one: named by the accelerator)."""
    accelerator = get_accelerator()
    device = accelerator.current_device()
    return torch.device(accelerator.current_device_name() if isinstance(device, int) else device)


class _ProfilingRun(Interpreter):
    """What both interpreters share: the graph run once on real inputs with the handle in profiling mode, the
    random state put back afterwards, and whatever a failure left gathered cleared."""

    def __init__(self, gm: GraphModule) -> None:
        super().__init__(gm)
        self.nz3 = get_deepcompile_handle()
        self.device = _device()
        self.distributed = dist.is_initialized()
        self.mem_usage_out_of_torch = 0

    def _profile(self, args: tuple) -> tuple[Any, BaseException | None]:
        """The graph's output and the error that stopped it (None: it ran to the end)."""
        try:
            if not _all_real_if_tensor(args):
                raise ValueError("a profiled graph's inputs must be real tensors, not fake ones")
            self.nz3.enable_profiling(True)
            self.mem_usage_out_of_torch = _get_mem_usage_out_of_torch()
            devices = [] if self.device.type == "cpu" else [self.device]
            with unset_fake_temporarily(), get_accelerator().random().fork_rng(devices=devices):
                return Interpreter.run(self, *args), None
        except Exception as error:  # noqa: BLE001 - the profile is incomplete; the caller goes on without it
            return None, error
        finally:
            try:
                self.nz3.clear_all_gathered_params()
            finally:
                self.nz3.enable_profiling(False)

    def _report(self, what: str, error: BaseException) -> None:
        if not self.distributed or dist.get_rank() == 0:
            print(f"DeepCompile {what} failed; the graph's profile is incomplete: {error}")


class ProfilingInterpreter(_ProfilingRun):
    """Each node's ``device_time``/``wall_time`` (ms, the mean of ``iteration`` runs after ``warmup`` untimed
    ones), ``alloc_mem``/``max_mem`` (bytes) and ``tensor_size`` in its ``meta``; a node run before with the same
    argument shapes on every rank reuses its figures and runs once, as does a release. A graph the run did not
    finish is marked incomplete (:func:`is_profile_incomplete`)."""

    def __init__(self, gm: GraphModule, iteration: int = 10, warmup: int = 5, debug_log: bool = False) -> None:
        super().__init__(gm)
        if iteration < 1 or warmup < 0:
            raise ValueError(f"profiling needs iteration >= 1 and warmup >= 0, not {iteration} and {warmup}")
        self.iteration, self.warmup, self.debug_log = iteration, warmup, debug_log
        self.cache: dict[tuple, tuple[float, float, int, int, int]] = {}
        self.allgather_mem: dict[int, int] = {}  # ds_id -> the bytes its gather allocated (a release frees them)

    def run(self, *args: object) -> Any:
        out, error = self._profile(args)
        if error is not None:
            self._report("profiling", error)
        _backfill_missing_profile_metadata(self.graph, profile_complete=error is None)
        return out

    def run_node(self, n: Node) -> Any:
        if n.op in ("placeholder", "output"):
            n.meta.update(device_time=0.0, wall_time=0.0, alloc_mem=0, max_mem=0)
            out = super().run_node(n)
            n.meta["tensor_size"] = _node_size(out)
            return out
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args = map_aggregate(args, lambda x: _to(x, self.device))
        kwargs = map_aggregate(kwargs, lambda x: _to(x, self.device))
        key = (n.target, _args_key(args), _args_key(kwargs))
        miss = torch.tensor([0 if key in self.cache else 1], dtype=torch.int32, device=self.device)
        if self.distributed:  # a figure is reused only where every rank has it, or their collectives part
            dist.all_reduce(miss, dist.ReduceOp.SUM)
        cached = miss.item() == 0
        release = is_release_node(n)
        runs = 1 if cached or release else self.iteration
        figures, out, error = (0.0, 0.0, 0, 0, 0), None, None
        try:  # where profiling runs out of memory: the failure is carried to the vote below, past the collectives
            out, figures = self._measure(n, args, kwargs, runs, warmup=0 if cached or release else self.warmup)
        except Exception as caught:  # noqa: BLE001 - every rank must reach the vote
            error = caught
        if not cached:
            with unset_fake_temporarily():
                agreed = torch.tensor(figures, dtype=torch.float64, device=self.device)
                if self.distributed:
                    dist.all_reduce(agreed, dist.ReduceOp.MAX)
            if error is None:
                device_time, wall_time, alloc, peak, size = agreed.tolist()
                self.cache[key] = (device_time, wall_time, int(alloc), int(peak), int(size))
        _abort_if_any_rank_failed(error, self.device, self.distributed)
        n.meta.update(zip(("device_time", "wall_time", "alloc_mem", "max_mem", "tensor_size"), self.cache[key]))
        if release:
            n.meta["alloc_mem"] = -self.allgather_mem.get(ds_id_of(n), 0)
        elif is_allgather_node(n):
            self.allgather_mem[ds_id_of(n)] = n.meta["alloc_mem"]
        if self.debug_log and (not self.distributed or dist.get_rank() == 0):
            print(f"{n.target} {n.meta['device_time']:.2f}ms {n.meta['wall_time']:.2f}ms "
                  f"alloc_mem={n.meta['alloc_mem']} max_mem={n.meta['max_mem']} tensor_size={n.meta['tensor_size']}")
        return out

    def _measure(self, n: Node, args: tuple, kwargs: dict, runs: int, warmup: int) -> tuple[Any, tuple]:
        accelerator = get_accelerator()
        starts = [accelerator.Event(enable_timing=True) for _ in range(runs)]
        ends = [accelerator.Event(enable_timing=True) for _ in range(runs)]
        accelerator.reset_peak_memory_stats()
        alloc_start, peak_start = accelerator.memory_allocated(), accelerator.max_memory_allocated()
        def run_target() -> Any:
            return getattr(self, n.op)(n.target, args, kwargs)

        _run_warmup_for_profile(run_target, warmup)
        if is_comm_op(n):
            dist.barrier()  # the collective's own time, not the wait for the last rank to arrive
        started = time.time()
        out = _run_repeatedly_for_profile(run_target, runs, starts, ends)
        accelerator.synchronize()
        wall_ms = (time.time() - started) / runs * 1000
        if is_comm_op(n):
            dist.barrier()
        # an accelerator without events (a CPU) runs in order: the wall time is the device's
        device_ms = wall_ms if None in starts else statistics.mean(s.elapsed_time(e) for s, e in zip(starts, ends))
        alloc = accelerator.memory_allocated() - alloc_start + self.mem_usage_out_of_torch
        peak = accelerator.max_memory_allocated() - peak_start + self.mem_usage_out_of_torch
        return out, (device_ms, wall_ms, alloc, peak, _node_size(out))


class MemoryProfilingInterpreter(_ProfilingRun):
    """The memory after each node, agreed over the ranks: ``mem_record`` rows ``(node name, bytes allocated, change,
    peak while it ran)``, as :func:`memory_records`' but measured; ``profile_complete`` False (and no rows) when the
    run did not finish."""

    def __init__(self, gm: GraphModule, debug_log: bool = False) -> None:
        super().__init__(gm)
        self.mem_record: list[tuple[str, int, int, int]] = []
        self.last_alloc = get_accelerator().memory_allocated()
        self.profile_complete = True
        self.debug_log = debug_log

    def run(self, *args: object) -> Any:
        self.profile_complete = True
        out, error = self._profile(args)
        if error is not None:
            self.profile_complete = False
            self.mem_record.clear()  # a partial record would plan as if the rest of the graph held nothing
            self._report("memory profiling", error)
        return out

    def run_node(self, n: Node) -> Any:
        accelerator = get_accelerator()
        accelerator.reset_peak_memory_stats()
        out, error = None, None
        try:
            if n.op in ("placeholder", "output"):
                out = super().run_node(n)
            else:
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                out = getattr(self, n.op)(n.target, map_aggregate(args, lambda x: _to(x, self.device)),
                                          map_aggregate(kwargs, lambda x: _to(x, self.device)))
                del args, kwargs
        except Exception as caught:  # noqa: BLE001 - the node's collectives come first, then the vote
            error = caught
        readings = torch.tensor([accelerator.memory_allocated() + self.mem_usage_out_of_torch,
                                 accelerator.max_memory_allocated() + self.mem_usage_out_of_torch],
                                dtype=torch.int64, device=self.device)
        if self.distributed:
            dist.all_reduce(readings, dist.ReduceOp.MAX)
        _abort_if_any_rank_failed(error, self.device, self.distributed)
        current, peak = (int(v) for v in readings.tolist())
        self.mem_record.append((n.name, current, current - self.last_alloc, peak))
        if self.debug_log and (not self.distributed or dist.get_rank() == 0):
            print(f"memory profile {len(self.mem_record)}/{len(self.graph.nodes)} {n.name}: {current} bytes "
                  f"({current - self.last_alloc:+d})")
        self.last_alloc = current
        return out
