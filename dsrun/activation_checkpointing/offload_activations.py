"""Checkpoint inputs moved to host memory until backward (DeepSpeed's
``deepspeed.runtime.activation_checkpointing.offload_activations``).

With non-reentrant checkpointing (``torch.utils.checkpoint(..., use_reentrant=False)``, as Hugging Face's
``GradientCheckpointingLayer`` runs it) the only activation a checkpointed layer keeps is its input, the hidden
states. ``CheckpointHiddenStatesOffload`` is a ``saved_tensors_hooks`` context: a tensor that was ``mark``-ed
before the layer ran is copied to a host buffer when autograd saves it and copied back when backward unpacks it;
every other saved tensor passes through. While the context is open, ``GradientCheckpointingLayer.__call__`` marks
its first positional argument itself (installed by the first open context, removed when the last one closes).

Which marked tensors move: only those on an asynchronous accelerator (on the CPU nothing needs to move: they
are counted as skipped), at least ``min_offload_bytes`` long, not a parameter or buffer, and not an overlapping
view (a stride of 0: its copy could not be written back in place). The newest ``keep_last_count`` stay on the
device (the first layers backward reaches would wait for their copies otherwise); each older one starts its copy
as a newer one arrives. With ``use_streams`` the copies run on a side stream: the forward does not wait for them,
the last ``max_fwd_stash_count`` sources stay referenced so that a backward reaching them early takes them
without a copy back, and restores are ordered after the side stream by events. Host buffers are dense (a strided
source's copy is contiguous, its strides rebuilt on the way back) and are reused by shape and dtype across steps,
up to ``max_cpu_buffer_pool_count`` of them; ``use_pin_memory`` takes them from the accelerator's ``pin_memory``.
``stats`` counts what was seen, marked, moved, restored, skipped and kept, and the bytes moved.
"""
from __future__ import annotations

import contextlib
import importlib.util
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.autograd.graph import saved_tensors_hooks

from dsrun.accelerator import get_accelerator


@dataclass
class CheckpointActivationOffloadStats:
    """Counters of one context's use (reset when it is entered)."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class _OffloadedTensorRef:
    """What autograd keeps in place of a moved tensor: the id of its host copy."""

    tensor_id: int


class _HostCopy(NamedTuple):
    buffer: torch.Tensor  # dense host copy
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    key: tuple


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * tensor.nelement()


class _ActivationOffloadEngine:
    """Moves tensors to host buffers and back: the keep-last window, the side stream, the forward stash and the
    host-buffer pool. ``offload_input(t)`` registers ``t`` (its id, or None when ``t`` is not moved) and
    ``restore_input(id)`` gives it back once."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1) -> None:
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.use_pin_memory = use_pin_memory
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0
        self._tracker: dict[int, _HostCopy] = {}  # id -> its host copy
        self._fwd_stash: dict[int, tuple[torch.Tensor, object]] = {}  # id -> (source, copy-done event)
        self._keep_last: dict[int, torch.Tensor] = {}  # the newest ids, still on the device, oldest first
        self._restored: dict[int, torch.Tensor] = {}  # restored once, for a backward that retains the graph
        self._cpu_buffer_pool: dict[tuple, list[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        self._pending_cpu_buffers: list[tuple[tuple, torch.Tensor, object]] = []  # in a copy back still running
        side = get_accelerator().Stream() if use_streams else None  # None on the CPU: no streams
        self.s1 = side
        self.use_streams = side is not None

    # --- streams -----------------------------------------------------------------------------------------
    @property
    def compute_stream(self):
        """The stream the model's work runs on (asked each time: the caller may switch streams)."""
        return get_accelerator().current_stream()

    def _stream_context(self, stream):
        return get_accelerator().stream(stream) if stream is not None else contextlib.nullcontext()

    # --- which tensors move -------------------------------------------------------------------------------
    def _should_skip(self, tensor: torch.Tensor) -> bool:
        accelerator = get_accelerator()
        buffer_class = getattr(torch.nn, "Buffer", None)
        return (accelerator.is_synchronized_device() or not accelerator.on_accelerator(tensor)
                or _nbytes(tensor) < self.min_offload_bytes or isinstance(tensor, torch.nn.Parameter)
                or (buffer_class is not None and isinstance(tensor, buffer_class))
                or (tensor.numel() > 1 and 0 in tensor.stride()))

    # --- host buffers -------------------------------------------------------------------------------------
    def _buffer_key(self, tensor: torch.Tensor) -> tuple:
        """Host buffers are dense, so tensors differing only in strides share one."""
        return tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory

    def _pool_cpu_buffer(self, key: tuple, buffer: torch.Tensor) -> None:
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(buffer)
            self._cpu_buffer_pool_count += 1

    def _reap_cpu_buffer_pool(self, force: bool = False) -> None:
        """Return to the pool the buffers whose copy back has finished (all of them, waiting, with ``force``)."""
        still_busy = []
        for key, buffer, event in self._pending_cpu_buffers:
            if force:
                event.synchronize()
            if force or event.query():
                self._pool_cpu_buffer(key, buffer)
            else:
                still_busy.append((key, buffer, event))
        self._pending_cpu_buffers = still_busy

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """A dense host buffer of ``tensor``'s size and dtype (from the pool when one is free) and its key."""
        self._reap_cpu_buffer_pool()
        key = self._buffer_key(tensor)
        free = self._cpu_buffer_pool.get(key)
        if free:
            self._cpu_buffer_pool_count -= 1
            return free.pop(), key
        buffer = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            buffer = get_accelerator().pin_memory(buffer, make_copy=False)
        return buffer, key

    # --- offload ------------------------------------------------------------------------------------------
    def _start_offload(self, tensor_id: int, tensor: torch.Tensor, reap_id: int | None = None) -> None:
        if self.use_streams:
            newest = tensor_id if reap_id is None else reap_id
            for stashed in [i for i in self._fwd_stash if i <= newest - self.max_fwd_stash_count]:
                del self._fwd_stash[stashed]  # record_stream keeps its memory until the side stream is done
            self.s1.wait_stream(self.compute_stream)
            stream = self.s1
        else:
            stream = self.compute_stream
        with self._stream_context(stream):
            buffer, key = self._empty_cpu_like(tensor)
            buffer.copy_(tensor.detach(), non_blocking=self.use_streams)
        self._tracker[tensor_id] = _HostCopy(buffer, tensor.device, tensor.size(), tuple(tensor.stride()), key)
        if self.use_streams:
            tensor.record_stream(self.s1)
            if self.max_fwd_stash_count > 0:
                self._fwd_stash[tensor_id] = (tensor, self.s1.record_event())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _nbytes(buffer)

    def offload_input(self, tensor: torch.Tensor) -> int | None:
        """Register ``tensor`` to move (its id), or None when it is not moved. The newest ``keep_last_count``
        stay on the device; registering one more starts the oldest kept one's copy."""
        if self._should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        tensor_id = self._next_id
        self._keep_last[tensor_id] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest = next(iter(self._keep_last))
            self._start_offload(oldest, self._keep_last.pop(oldest), reap_id=tensor_id)
        return tensor_id

    # --- restore ------------------------------------------------------------------------------------------
    def restore_input(self, tensor_id: int) -> torch.Tensor:
        """The tensor registered as ``tensor_id``, back on its device (once: it is forgotten)."""
        return self._restore_tensor(tensor_id, cache=False)

    def _restore_tensor(self, tensor_id: int, cache: bool = True) -> torch.Tensor:
        if cache and tensor_id in self._restored:
            return self._restored[tensor_id]
        if tensor_id in self._keep_last:
            self.stats.kept_last_tensors += 1
            tensor = self._keep_last.pop(tensor_id)
        elif tensor_id in self._fwd_stash:  # the source is still referenced: no copy back
            tensor, event = self._fwd_stash.pop(tensor_id)
            self.compute_stream.wait_event(event)
            copy = self._tracker.pop(tensor_id)
            self._pool_cpu_buffer(copy.key, copy.buffer)
            self._count_restore(tensor)
        else:
            tensor = self._copy_back(tensor_id)
        if cache:
            self._restored[tensor_id] = tensor
        return tensor

    def _copy_back(self, tensor_id: int) -> torch.Tensor:
        copy = self._tracker.pop(tensor_id, None)
        if copy is None:
            raise RuntimeError(f"offloaded activation {tensor_id} is no longer tracked: backward() must run "
                               "before the offload context is reset or closed")
        stream = self.s1 if self.use_streams else self.compute_stream
        with self._stream_context(stream):
            # fresh storage at offset 0 with the source's strides (the dense buffer holds its elements in order)
            tensor = torch.empty_strided(copy.size, copy.stride, dtype=copy.buffer.dtype, device=copy.device)
            tensor.copy_(copy.buffer, non_blocking=self.use_streams)
        if self.use_streams:
            done = self.s1.record_event()
            self.compute_stream.wait_event(done)
            tensor.record_stream(self.compute_stream)
            self._pending_cpu_buffers.append((copy.key, copy.buffer, done))
        else:
            self._pool_cpu_buffer(copy.key, copy.buffer)
        self._count_restore(tensor)
        return tensor

    def _count_restore(self, tensor: torch.Tensor) -> None:
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _nbytes(tensor)

    # --- lifetime -----------------------------------------------------------------------------------------
    def _sync_copy_streams(self) -> None:
        if self.use_streams:
            self.s1.synchronize()
            self._reap_cpu_buffer_pool(force=True)

    def _forget(self) -> None:
        for held in (self._tracker, self._fwd_stash, self._keep_last, self._restored):
            held.clear()
        self._pending_cpu_buffers.clear()

    def reset(self) -> None:
        """Wait for running copies, then forget every tensor and zero the counters (the pool is kept)."""
        self._sync_copy_streams()
        self.stats = CheckpointActivationOffloadStats()
        self._forget()
        self._next_id = 0

    def _sync_and_clear(self) -> None:
        """At the context's end: wait for the copies, return unrestored buffers to the pool, forget the rest."""
        self._sync_copy_streams()
        for copy in self._tracker.values():
            self._pool_cpu_buffer(copy.key, copy.buffer)
        self._forget()


# --- the marker on Hugging Face's GradientCheckpointingLayer ----------------------------------------------------
_TLS = threading.local()  # each thread's open contexts, innermost last
_PATCH_LOCK = threading.Lock()
_MARKER_WRAPPER = None  # the installed __call__, None when not installed
_ORIGINAL_OWN_CALL = None  # the class's own __call__ before it (None: it inherited nn.Module's)
_MARKER_INSTALLED_BY_CONTEXT = False
_PATCH_USERS = 0  # open contexts using the installed marker


def _manager_stack() -> list:
    if not hasattr(_TLS, "stack"):
        _TLS.stack = []
    return _TLS.stack


def _current_manager() -> CheckpointHiddenStatesOffload | None:
    stack = _manager_stack()
    return stack[-1] if stack else None


def patch_gradient_checkpointing_layer_marker() -> None:
    """Make ``transformers.GradientCheckpointingLayer.__call__`` mark its first positional argument (the hidden
    states it checkpoints) with the innermost open context, while training under checkpointing with grad on."""
    global _MARKER_WRAPPER, _ORIGINAL_OWN_CALL
    if _MARKER_WRAPPER is not None:
        return
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError as err:
        raise RuntimeError("patch_gradient_checkpointing_layer_marker needs transformers >= 4.52 (which has "
                           "GradientCheckpointingLayer): pip install transformers") from err
    original = GradientCheckpointingLayer.__call__

    def _checkpoint_offload_call(self, *args, **kwargs):
        manager = _current_manager()
        marked = None
        if (manager is not None and self.training and torch.is_grad_enabled()
                and getattr(self, "gradient_checkpointing", False) and args and torch.is_tensor(args[0])):
            marked = args[0]  # a keyword hidden_states is not what the checkpoint saves: left alone
            manager.mark(marked)
        try:
            return original(self, *args, **kwargs)
        finally:
            if marked is not None:
                manager._consume_mark(marked)  # ids are reused: drop a mark no pack consumed

    _ORIGINAL_OWN_CALL = GradientCheckpointingLayer.__dict__.get("__call__")
    GradientCheckpointingLayer.__call__ = _checkpoint_offload_call
    _MARKER_WRAPPER = _checkpoint_offload_call


def _unpatch_gradient_checkpointing_layer_marker() -> None:
    global _MARKER_WRAPPER, _ORIGINAL_OWN_CALL
    wrapper, own = _MARKER_WRAPPER, _ORIGINAL_OWN_CALL
    _MARKER_WRAPPER = _ORIGINAL_OWN_CALL = None
    if wrapper is None:
        return
    from transformers import GradientCheckpointingLayer
    if GradientCheckpointingLayer.__call__ is not wrapper:  # someone patched over it since: leave theirs
        return
    if own is None:
        del GradientCheckpointingLayer.__call__
    else:
        GradientCheckpointingLayer.__call__ = own


class CheckpointHiddenStatesOffload(_ActivationOffloadEngine, saved_tensors_hooks):
    """A ``saved_tensors_hooks`` context that moves only ``mark``-ed saved tensors to host memory (module
    docstring). Not re-entrant; nest separate instances (the innermost receives the marks)."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1) -> None:
        _ActivationOffloadEngine.__init__(self, use_pin_memory=use_pin_memory, use_streams=use_streams,
                                          min_offload_bytes=min_offload_bytes,
                                          max_fwd_stash_count=max_fwd_stash_count,
                                          max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                          keep_last_count=keep_last_count)
        self._allowed: dict[int, int] = {}  # id(tensor) -> marks not yet consumed
        saved_tensors_hooks.__init__(self, self._pack_tensor, self._unpack_tensor)

    def mark(self, tensor: torch.Tensor) -> None:
        """Move ``tensor`` when autograd next saves it in this context."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        count = self._allowed.get(id(tensor), 0)
        if count <= 0:
            return False
        if count == 1:
            del self._allowed[id(tensor)]
        else:
            self._allowed[id(tensor)] = count - 1
        return True

    def _pack_tensor(self, tensor: torch.Tensor):
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        tensor_id = self.offload_input(tensor)
        return tensor if tensor_id is None else _OffloadedTensorRef(tensor_id)

    def _unpack_tensor(self, packed):
        if isinstance(packed, _OffloadedTensorRef):
            return self._restore_tensor(packed.tensor_id, cache=True)
        return packed

    def reset(self) -> None:
        super().reset()
        self._allowed.clear()

    def _sync_and_clear(self) -> None:
        super()._sync_and_clear()
        self._allowed.clear()

    def _pop_manager_stack(self) -> None:
        global _MARKER_INSTALLED_BY_CONTEXT, _PATCH_USERS
        stack = _manager_stack()
        if self in stack:
            stack.remove(self)
        with _PATCH_LOCK:
            _PATCH_USERS = max(0, _PATCH_USERS - 1)
            if _PATCH_USERS == 0 and _MARKER_INSTALLED_BY_CONTEXT:
                _unpatch_gradient_checkpointing_layer_marker()
                _MARKER_INSTALLED_BY_CONTEXT = False

    def __enter__(self):
        global _MARKER_INSTALLED_BY_CONTEXT, _PATCH_USERS
        if self in _manager_stack():
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant; use a separate instance for a "
                               "nested context")
        with _PATCH_LOCK:
            if _MARKER_WRAPPER is None and importlib.util.find_spec("transformers") is not None:
                patch_gradient_checkpointing_layer_marker()
                _MARKER_INSTALLED_BY_CONTEXT = True
            if _MARKER_WRAPPER is not None:
                _PATCH_USERS += 1
        self.reset()
        _manager_stack().append(self)
        try:
            return saved_tensors_hooks.__enter__(self)
        except Exception:
            self._pop_manager_stack()
            raise

    def __exit__(self, *exc_info):
        sync_error = None
        try:
            self._sync_and_clear()
        except Exception as err:  # still close the hooks and the marker; raised below
            sync_error = err
        try:
            self._pop_manager_stack()
        finally:
            result = saved_tensors_hooks.__exit__(self, *exc_info)
        if sync_error is not None:
            raise sync_error
        return result


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A new :class:`CheckpointHiddenStatesOffload` with these settings."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)
