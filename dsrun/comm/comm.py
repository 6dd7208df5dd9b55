"""The only door to ``torch.distributed``: process-group setup and the collectives dsrun uses.

Every collective is recorded in the comms logger (:mod:`dsrun.comm.logger`) with its message and traffic
bytes, so the engine, the monitor and the tests can see what a training step moved. Names and signatures
follow ``deepspeed.comm`` (which follows ``torch.distributed``), so code written against either works.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import sys
import types
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from dsrun.accelerator import get_accelerator
from dsrun.config import ds_section
from dsrun.utils.net import free_port

from .logger import CommsLogger, Timer, format_summary, straggler_breakdown

ReduceOp = dist.ReduceOp
ProcessGroup = Optional["dist.ProcessGroup"]  # a torch group, or None for the default (world) group

comms_logger = CommsLogger()
_T = TypeVar("_T")


class _CommsLoggerHolder(Protocol):
    """A config object read by :func:`configure`: its ``comms_logger`` section, a dict or an object with the
    section's keys as attributes."""

    comms_logger: object

# torch >= 2.10 renamed the tensor-shaped collectives; prefer the new names when present.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: dict | None = None,
                     rank: int = -1, world_size: int = -1, *, store: dist.Store | None = None) -> None:
    """Initialize torch.distributed, as ``deepspeed.init_distributed`` does.

    The backend defaults to the accelerator's (gloo on CPU, NCCL on CUDA). Rank and world size come from the
    arguments or the ``RANK``/``WORLD_SIZE`` environment (set by ``dsrun`` and ``torchrun``); without either,
    a single-process world on 127.0.0.1 is created so a plain ``python train.py`` works. ``timeout`` bounds
    every collective: a rank that never joins (it failed, or took another path) makes the others fail after it
    with one line naming the collective (:class:`CollectiveTimeout`) instead of hanging; None is DeepSpeed's
    default, ``DEEPSPEED_TIMEOUT`` minutes (10 when unset: :func:`default_pg_timeout`).
    ``config`` may carry a ``comms_logger`` section (a dict or an object with those attributes).
    ``auto_mpi_discovery`` is accepted for compatibility; MPI launch is not supported. ``store`` (dsrun's, not
    DeepSpeed's; with ``rank`` and ``world_size``): meet there instead of at ``MASTER_ADDR:MASTER_PORT``
    (:func:`rendezvous_store`).
    """
    from dsrun.launcher.protocol import install_user_error_hook

    install_user_error_hook()  # under dsrun's launcher: a user's mistake is one line, not a traceback per rank
    if config is not None:
        configure(config)
    if dist_init_required is False:
        return
    _destroy_at_exit.register()
    if dist.is_initialized():
        return
    _import_before_world()
    if rank < 0 and "RANK" not in os.environ:
        # A single process started by hand: make a world of one.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or get_accelerator().communication_backend_name()
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout or default_pg_timeout()}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if store is not None:
        kwargs["store"] = store
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    if backend == "nccl":
        get_accelerator().set_device(get_local_rank())
        # binds the process group to this rank's GPU, so barrier() and friends need not guess it
        kwargs["device_id"] = get_accelerator().device(get_local_rank())
    dist.init_process_group(**kwargs)
    comms_logger.rank = get_rank()
    if verbose and get_rank() == 0:
        print(f"[dsrun] initialized torch.distributed: backend={backend} world_size={get_world_size()}",
              flush=True)


def default_pg_timeout() -> timedelta:
    """DeepSpeed's ``deepspeed.constants.default_pg_timeout``: ``DEEPSPEED_TIMEOUT`` minutes, 10 when unset (read
    when asked, not at import)."""
    value = os.environ.get("DEEPSPEED_TIMEOUT", "10")
    try:
        return timedelta(minutes=float(value))
    except ValueError:
        raise ValueError(f"DEEPSPEED_TIMEOUT={value!r}: expected minutes (a number), e.g. DEEPSPEED_TIMEOUT=10") from None


class CollectiveTimeout(RuntimeError):
    """A collective this rank entered timed out: a rank of its group never reached it."""


def rendezvous_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta,
                     ops_timeout: timedelta | None = None) -> dist.Store:
    """The store ranks meet on, for :func:`init_distributed`'s ``store``: rank 0's server (``port`` 0: one the
    system picks as it binds, read back as ``.port``, so no other process can hold it), or another rank's client
    of it at ``host:port``, which gives up after ``timeout`` when no server answers there. Once connected, a wait
    on the store lasts up to ``ops_timeout`` (init_distributed's default for the collectives)."""
    store = dist.TCPStore(host, port, world_size, is_master, timeout, wait_for_workers=False)
    store.set_timeout(ops_timeout or default_pg_timeout())
    return store


# torch.distributed.nn.functional declares its collectives with ``group=group.WORLD`` as a default argument, an
# expression evaluated when the module is first imported, and torch imports it lazily the first time an
# optimizer is built (torch.optim -> torch._dynamo -> fsdp -> _shard). Imported after the default group exists,
# it pins that group in ten functions' defaults: destroy_process_group() then drops torch's own references but
# the group lives on, and with it gloo's worker threads, its transport loop and (rank 0) the TCPStore server,
# into interpreter finalization, where a worker dropping its last work (whose tensors need the GIL) aborts the
# finished rank ("terminate called without an active exception", SIGABRT; 2 exits in ~25 of vs_deepspeed.py).
# Imported while no group exists, the defaults are None (the default group at call time), so dsrun imports it
# with ``dsrun.comm``, before any group can exist.
_WORLD_DEFAULT_MODULE = "torch.distributed.nn.functional"


def _import_before_world() -> None:
    if _WORLD_DEFAULT_MODULE not in sys.modules and not is_initialized():
        try:
            importlib.import_module(_WORLD_DEFAULT_MODULE)
        except Exception:  # noqa: BLE001 - a torch built without it has nothing to pin a group with
            pass


def _unpin_world_defaults() -> None:
    """Replace every process group pinned in torch.distributed.nn.functional's default arguments (the default
    group of a world created before that module was imported) by None, the default group at call time, so a
    destroyed world is freed now rather than at interpreter exit."""
    module = sys.modules.get(_WORLD_DEFAULT_MODULE)
    for fn in list(vars(module).values()) if module is not None else []:
        defaults = fn.__defaults__ if isinstance(fn, types.FunctionType) else None
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


class _DestroyAtExit:
    """Tear the default group down before the interpreter does, whoever created it (accelerate creates it
    before calling ``deepspeed.init_distributed``): a script that never calls ``destroy_process_group``
    (Hugging Face's Trainer, most DeepSpeed scripts) otherwise leaves gloo's threads to static destructors,
    which can abort a rank whose work is done ("terminate called without an active exception"). Local only:
    no collective, so ranks that already left do not matter."""

    registered = False

    def register(self) -> None:
        if not self.registered:
            atexit.register(self)
            self.registered = True

    def __call__(self) -> None:
        try:
            _run_before_destroy()
            if is_initialized():
                dist.destroy_process_group()
            _unpin_world_defaults()  # a world destroyed by the script itself may still be pinned
        except Exception:  # noqa: BLE001 - at exit, a failed teardown must not mask the script's own status
            pass


_destroy_at_exit = _DestroyAtExit()


def destroy_at_exit() -> None:
    """Destroy the default process group at interpreter exit (once), whoever created it."""
    _destroy_at_exit.register()


def configure(config: dict[str, Any] | _CommsLoggerHolder | None = None, enabled: bool | None = None,
              verbose: bool | None = None, prof_all: bool | None = None,
              prof_ops: Sequence[str] | None = None, debug: bool | None = None) -> None:
    """Configure the comms logger from a DeepSpeed config (its ``comms_logger`` section) or keywords."""
    section: object = None  # a typed section, or a holder's section (a dict or an object with its keys)
    if isinstance(config, dict):  # a raw config: the keys it sets, typed (the others keep the logger's values)
        typed = ds_section(config, "comms_logger")
        section = {key: getattr(typed, key) for key in typed.model_fields_set}
    elif config is not None:
        section = getattr(config, "comms_logger", None)

    def pick(name: str, given: _T | None, default: _T) -> _T:
        if given is not None:
            return given
        if section is None:
            return default
        return section.get(name, default) if isinstance(section, dict) else getattr(section, name, default)

    comms_logger.configure(enabled=pick("enabled", enabled, comms_logger.enabled),
                           verbose=pick("verbose", verbose, comms_logger.verbose),
                           prof_all=pick("prof_all", prof_all, comms_logger.prof_all),
                           prof_ops=pick("prof_ops", prof_ops, comms_logger.prof_ops) or [],
                           debug=pick("debug", debug, comms_logger.debug))


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup = None) -> int:
    return dist.get_rank(group) if is_initialized() else int(os.environ.get("RANK", "0"))


def get_world_size(group: ProcessGroup = None) -> int:
    return dist.get_world_size(group) if is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def get_world_group() -> ProcessGroup:
    """DeepSpeed's ``comm.get_world_group``: the group of every rank (torch's ``group.WORLD``)."""
    return dist.group.WORLD


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The global rank of ``group_rank`` within ``group``."""
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_backend(group: ProcessGroup = None) -> str:
    return dist.get_backend(group)


def new_group(ranks: Sequence[int] | None = None, timeout: timedelta | None = None, local: bool = False,
              backend: str | None = None) -> ProcessGroup:
    """A process group of ``ranks``; every rank of the world must call it, unless ``local`` (then only the
    members do: torch's ``use_local_synchronization``). ``backend``: the world's unless named (``"gloo"``: host
    tensors, e.g. a group a background thread uses while training runs collectives on the world's)."""
    return dist.new_group(ranks=list(ranks) if ranks is not None else None, timeout=timeout,
                          use_local_synchronization=local, backend=backend)


_before_destroy: list[Callable[[], None]] = []


def before_destroy(hook: Callable[[], None]) -> None:
    """Run ``hook`` (once) before the world is next destroyed (``destroy_process_group()`` without a group, or
    at exit): a user of a group of its own finishes with it first (a decoupled checkpoint's writer thread
    waits for its write there)."""
    if hook not in _before_destroy:
        _before_destroy.append(hook)


def _run_before_destroy() -> None:
    while _before_destroy:
        _before_destroy.pop(0)()


def destroy_process_group(group: ProcessGroup = None) -> None:
    """Destroy ``group`` (None: every group and the world). The world's threads end here, not at exit."""
    if group is None:
        _run_before_destroy()
    if is_initialized():
        dist.destroy_process_group(group)
    if group is None:
        _unpin_world_defaults()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def group_ranks(group: ProcessGroup = None) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the world), in group-rank order."""
    if group is None or not is_initialized():
        return tuple(range(get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _run(op: str, message_bytes: int, traffic: float, call: Callable[[], Any], async_op: bool,
         group: ProcessGroup = None) -> Any:
    ranks = group_ranks(group)
    if async_op and not comms_logger.timing(op):
        work = call()
        comms_logger.record(op, message_bytes, traffic, group=ranks)
        return work
    with Timer() as t, _named_timeout(op, ranks):
        work = call()
        if async_op:  # the comms logger times every logged op to completion, as DeepSpeed does
            work.wait()
    comms_logger.record(op, message_bytes, traffic, t.elapsed, group=ranks)
    return work


@contextlib.contextmanager
def _named_timeout(op: str, ranks: Sequence[int]) -> Iterator[None]:
    """A backend's timeout inside as one line naming the collective and its ranks (gloo's names a socket buffer)."""
    try:
        yield
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if "timed out" not in first.lower():
            raise
        raise CollectiveTimeout(f"rank {get_rank()}: {op} over ranks {list(ranks)} timed out ({first}): a rank of the "
                                "group never reached it (an exception there, or another code path); DEEPSPEED_TIMEOUT "
                                "(minutes) or init_distributed(timeout=...) sets the bound") from None


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup = None,
               async_op: bool = False) -> Any:
    n = get_world_size(group)
    size = _nbytes(tensor)
    return _run("all_reduce", size, 2 * size * (n - 1) / n,
                lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op, group)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: ProcessGroup = None, async_op: bool = False) -> Any:
    """Reduce ``input`` (N equal pieces, piece r for rank r) across ranks; rank r gets piece r in ``output``."""
    n = get_world_size(group)
    size = _nbytes(input)
    return _run("reduce_scatter", size, size * (n - 1) / n,
                lambda: _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op),
                async_op, group)


def reduce_scatter(output: torch.Tensor, input_list: Sequence[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                   group: ProcessGroup = None, async_op: bool = False) -> Any:
    """Reduce-scatter with one input tensor per rank; pieces may differ in size (some may be empty)."""
    total = sum(_nbytes(t) for t in input_list)
    own = _nbytes(input_list[get_rank(group)])
    return _run("reduce_scatter", total, total - own,
                lambda: dist.reduce_scatter(output, list(input_list), op=op, group=group, async_op=async_op),
                async_op, group)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup = None,
                           async_op: bool = False) -> Any:
    """Gather every rank's ``input`` into ``output`` (rank r's at piece r)."""
    n = get_world_size(group)
    size = _nbytes(output)
    return _run("all_gather", size, size * (n - 1) / n,
                lambda: _all_gather_single(output, input, group=group, async_op=async_op), async_op, group)


def all_gather(tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup = None,
               async_op: bool = False) -> Any:
    total = sum(_nbytes(t) for t in tensor_list)
    return _run("all_gather", total, total - _nbytes(tensor),
                lambda: dist.all_gather(list(tensor_list), tensor, group=group, async_op=async_op), async_op, group)


# --- DeepSpeed's capability-checked collectives (deepspeed.comm.allgather_fn & co.) --------------------------
_BACKEND_NOT_SET = "DeepSpeed backend not set, please initialize it using init_process_group()"


def _require_initialized() -> None:
    # DeepSpeed asserts its backend exists; the same error type and message (not stripped by python -O)
    if not is_initialized():
        raise AssertionError(_BACKEND_NOT_SET)


def has_all_gather_into_tensor() -> bool:
    """Whether torch has the single-tensor all-gather (:func:`allgather_fn` then uses it). Raises
    AssertionError before ``init_distributed``, as DeepSpeed does."""
    _require_initialized()
    return _all_gather_single is not None


def has_reduce_scatter_tensor() -> bool:
    """Whether torch has the single-tensor reduce-scatter (:func:`reduce_scatter_fn` then uses it). Raises
    AssertionError before ``init_distributed``, as DeepSpeed does."""
    _require_initialized()
    return _reduce_scatter_single is not None


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup = None,
                 async_op: bool = False, debug: str | None = None) -> Any:
    """DeepSpeed's all-gather into one flat ``output_tensor`` (rank r's ``input_tensor`` at piece r): the
    single-tensor collective, or where torch lacks it an all-gather into ``output_tensor``'s pieces.
    ``debug`` is DeepSpeed's caller label for its comms log; dsrun's logger keys by op, so it is unused."""
    _require_initialized()
    if has_all_gather_into_tensor():
        return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
    pieces = list(torch.chunk(output_tensor, get_world_size(group)))
    return all_gather(pieces, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                      group: ProcessGroup = None, async_op: bool = False, prof: bool = False,
                      debug: str | None = None) -> Any:
    """DeepSpeed's reduce-scatter of one flat ``tensor`` (N equal pieces) into ``output_tensor``: the
    single-tensor collective, or where torch lacks it the list form over ``tensor``'s pieces. ``prof`` and
    ``debug`` are DeepSpeed's per-call logging switches; dsrun's comms logger records every call already."""
    _require_initialized()
    if has_reduce_scatter_tensor():
        return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)
    pieces = list(torch.chunk(tensor, get_world_size(group)))
    return reduce_scatter(output_tensor, pieces, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, group: ProcessGroup = None,
                      async_op: bool = False) -> Any:
    """Rank r sends piece j of ``input`` (dim 0) to rank j and receives rank j's piece r into piece j of
    ``output``; pieces are equal unless split sizes (rows along dim 0) are given. The tensor form is the one
    gloo and NCCL both have (MoE's token exchange). Logged with the input as the message; the traffic is
    what leaves this rank (the input less its own piece)."""
    n = get_world_size(group)
    size = _nbytes(input)
    if input_split_sizes is not None:
        row = size // max(1, input.shape[0]) if input.dim() else 0
        own = row * int(input_split_sizes[get_rank(group)])
    else:
        own = size // n
    return _run("all_to_all_single", size, size - own,
                lambda: dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                               input_split_sizes=input_split_sizes, group=group,
                                               async_op=async_op), async_op, group)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup = None, async_op: bool = False) -> Any:
    size = _nbytes(tensor)
    return _run("broadcast", size, size if get_world_size(group) > 1 else 0,
                lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op, group)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup = None,
           async_op: bool = False) -> Any:
    size = _nbytes(tensor)
    return _run("reduce", size, size if get_world_size(group) > 1 else 0,
                lambda: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op), async_op, group)


# --- point to point (the pipeline engine's activations and gradients) -----------------------------------
P2POp = dist.P2POp


def _record_p2p(op: str, tensor: torch.Tensor) -> None:
    # never timed: waiting on a send inside the logger would stall a pair that has not posted its receive yet
    comms_logger.record(op, _nbytes(tensor), _nbytes(tensor))


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking until the transport has it)."""
    _record_p2p("send", tensor)
    dist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup = None, tag: int = 0) -> None:
    """Receive into ``tensor`` from global rank ``src`` (blocking)."""
    _record_p2p("recv", tensor)
    dist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup = None, tag: int = 0) -> Any:
    _record_p2p("send", tensor)
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup = None, tag: int = 0) -> Any:
    _record_p2p("recv", tensor)
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def send_op(tensor: torch.Tensor, peer: int, group: ProcessGroup = None, tag: int = 0) -> Any:
    """A send of ``tensor`` to global rank ``peer``, for :func:`batch_isend_irecv`."""
    return P2POp(dist.isend, tensor, peer, group=group, tag=tag)


def recv_op(tensor: torch.Tensor, peer: int, group: ProcessGroup = None, tag: int = 0) -> Any:
    """A receive into ``tensor`` from global rank ``peer``, for :func:`batch_isend_irecv`."""
    return P2POp(dist.irecv, tensor, peer, group=group, tag=tag)


def batch_isend_irecv(ops: Sequence[Any]) -> list[Any]:
    """Post a batch of sends and receives (:func:`send_op`, :func:`recv_op`) at once and return their works.
    NCCL runs them as one group, so two ranks that send to each other in the same batch cannot deadlock
    whatever the order; gloo matches them by tag."""
    for op in ops:
        _record_p2p("send" if op.op in (dist.isend, dist.send) else "recv", op.tensor)
    if not ops:
        return []
    return list(dist.batch_isend_irecv(list(ops)))


def all_gather_object(object_list: list, obj: object, group: ProcessGroup = None) -> None:
    """Gather ``obj`` (any picklable object) from every rank into ``object_list``."""
    comms_logger.record("all_gather_object", 0, 0)
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int = 0, group: ProcessGroup = None) -> None:
    comms_logger.record("broadcast_object_list", 0, 0)
    dist.broadcast_object_list(object_list, src=src, group=group)


def barrier(group: ProcessGroup = None) -> None:
    if get_world_size(group) == 1 and not is_initialized():
        return
    with Timer() as t, _named_timeout("barrier", group_ranks(group)):
        dist.barrier(group=group)
    comms_logger.record("barrier", 0, 0, t.elapsed)


def get_comms_stats() -> dict[str, dict[str, float]]:
    """Totals per op since the last reset: {op: {count, message_bytes, traffic_bytes, latency_s}}."""
    return comms_logger.snapshot()


def get_comms_group_stats() -> dict[str, dict[str, dict[str, float]]]:
    """Totals per op and process group since the last reset: {op: {"0,1": {count, message_bytes, ...}}}, each
    group named by its global ranks (what MiCS and hpZ tests read: which group carried a collective)."""
    return comms_logger.group_snapshot()


def reset_comms_stats() -> None:
    comms_logger.reset()


def log_summary(show_straggler: bool = False) -> dict[str, Any]:
    """Print DeepSpeed's summary table on rank 0 and return its data on every rank:
    ``{op: {count, message_bytes, traffic_bytes, sizes: [{message_bytes, count, total_latency_ms,
    avg_latency_ms, algbw_gbps, busbw_gbps}, ...]}}``. With ``show_straggler`` each op also gets
    ``"straggler"`` rows, and every rank must call it (it gathers all ranks' latencies)."""
    ops = comms_logger.summary_data()
    straggler = None
    if show_straggler:
        own = comms_logger.latencies()
        every = [own]
        if is_initialized() and get_world_size() > 1:
            every = [None] * get_world_size()
            dist.all_gather_object(every, own)  # straight to torch: the summary itself is not counted
        straggler = straggler_breakdown(own, every)
        for op, rows in straggler.items():
            ops[op]["straggler"] = rows
    if get_rank() == 0:
        print(format_summary(ops, straggler), flush=True)
    return ops


def comms_report(show_straggler: bool = False) -> dict[str, Any]:
    """What ``comms.json`` holds: ``{"world_size", "rank", "ops": log_summary's data, "table": text}``.
    Prints nothing; with ``show_straggler`` every rank must call it."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        ops = log_summary(show_straggler)
    straggler = {op: entry["straggler"] for op, entry in ops.items() if "straggler" in entry}
    return {"world_size": get_world_size(), "rank": get_rank(), "ops": ops,
            "table": format_summary(ops, straggler if show_straggler else None)}


_import_before_world()
