"""``deepspeed.utils.pin_memory``: DeepSpeed's native pinned-memory manager, ``DS_PIN_MEMORY_BACKEND=native``.

torch pins host memory only through an accelerator's driver (``tensor.pin_memory()`` needs CUDA). The native
backend page-locks host memory itself: a page-aligned ``posix_memalign`` block locked with ``mlock`` (never
swapped out; it counts against the memlock limit, ``ulimit -l``), as DeepSpeed's ``pin_memory`` op does. Here the
op is libc through ctypes, so there is nothing to compile.

* :class:`PageLockedAllocator` is the op's handle (``op_builder.PinMemoryBuilder().load().pin_handle()``):
  ``new_cpu_locked_tensor(numel, like)`` and ``free_cpu_locked_tensor(_by_ptr)``, ``is_pinned`` (the whole byte
  extent inside one locked block, so views count).
* :class:`NativePinnedMemory` pins copies of tensors through it and keeps DeepSpeed's bookkeeping: ``_ranges``
  (block address -> end), ``ds_pinned`` / ``ds_pin_base`` on the returned tensor, ``unpin`` (releases the block
  recorded at pin time, even after ``.data`` was redirected), and a finalizer that frees a block once its root
  tensor and every view of it are gone, as torch frees pinned memory. One difference from DeepSpeed: ``unpin``
  unlocks at once but leaves the free to that finalizer, so no live view is left reading freed memory.
* ``get_active_native_pinned_memory()`` is the process-wide manager when ``DS_PIN_MEMORY_BACKEND=native``, else
  None; the accelerator's ``pin_memory`` / ``is_pinned`` / ``unpin_memory`` route through it, and the offloaded
  optimizer's host buffers (``offload_optimizer.pin_memory``) are pinned by it and released at ``engine.destroy()``.
  It takes its handle from ``op_builder.PinMemoryBuilder().load()`` as DeepSpeed's does, and raises RuntimeError
  naming the op where that fails (no silent fall back to torch's pinning).
"""
from __future__ import annotations

import ctypes
import os
import threading
import weakref

import torch

try:
    from torch._subclasses.fake_tensor import is_fake as _is_fake_tensor
except ImportError:  # a private torch API
    _is_fake_tensor = None

BACKEND_ENV = "DS_PIN_MEMORY_BACKEND"


class PageLockedAllocator:
    """DeepSpeed's pin handle: page-aligned host blocks locked with ``mlock``, each tracked until freed."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        for name in ("mlock", "munlock"):
            getattr(self._libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc.free.argtypes = [ctypes.c_void_p]
        self._page = os.sysconf("SC_PAGESIZE")
        self._blocks: dict[int, int] = {}  # address -> bytes, every block not freed yet
        self._locked: set[int] = set()  # the blocks still page-locked
        self._lock = threading.Lock()

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype in a fresh locked block (not
        zeroed). Raises RuntimeError naming the memlock limit where ``mlock`` is refused."""
        dtype = example_tensor.dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = int(num_elem) * itemsize
        size = max(nbytes, itemsize)  # a zero-element tensor still gets a block of its own (a distinct address)
        address = ctypes.c_void_p()
        if self._libc.posix_memalign(ctypes.byref(address), self._page, size) != 0:
            raise MemoryError(f"pin_memory: could not allocate {nbytes} bytes of host memory")
        if self._libc.mlock(address, size) != 0:
            err = ctypes.get_errno()
            self._libc.free(address)
            raise RuntimeError(f"pin_memory: mlock of {nbytes} bytes failed ({os.strerror(err)}); raise the memlock "
                               f"limit (ulimit -l) or leave {BACKEND_ENV} unset for torch's pinning")
        with self._lock:
            self._blocks[address.value] = size
            self._locked.add(address.value)
        block = (ctypes.c_byte * size).from_address(address.value)
        # a tensor of its own, no view: views of it keep it (and so the block) alive through ``_base``
        return torch.frombuffer(block, dtype=dtype, count=size // itemsize)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return self.free_cpu_locked_tensor_by_ptr(tensor.data_ptr())

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Unlock and free the block at ``address``; False when no block starts there. Any tensor still viewing
        the block reads freed memory afterwards: the caller owns that."""
        with self._lock:
            size = self._blocks.pop(int(address), None)
            self._locked.discard(int(address))
        if size is None:
            return False
        self._libc.munlock(ctypes.c_void_p(address), size)
        self._libc.free(ctypes.c_void_p(address))
        return True

    def unlock_by_ptr(self, address: int) -> bool:
        """Unlock the block at ``address`` now and keep its memory until it is freed (True if it was locked):
        the pin is released while tensors may still view the block."""
        with self._lock:
            if int(address) not in self._locked:
                return False
            self._locked.discard(int(address))
            size = self._blocks[int(address)]
        self._libc.munlock(ctypes.c_void_p(address), size)
        return True

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s whole byte extent lies inside one locked block (views and slices count)."""
        if tensor.device.type != "cpu":
            return False
        start = tensor.data_ptr()
        end = start + tensor.nbytes
        with self._lock:
            return any(base <= start and end <= base + self._blocks[base] for base in self._locked)


_allocator: PageLockedAllocator | None = None


def pin_handle() -> PageLockedAllocator:
    """The process-wide allocator (DeepSpeed's op module's ``pin_handle()``: one manager per process)."""
    global _allocator
    if _allocator is None:
        _allocator = PageLockedAllocator()
    return _allocator


class NativePinnedMemory:
    """Pinned copies of tensors in page-locked blocks, with DeepSpeed's bookkeeping (module docstring)."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}  # block address -> end of the pinned bytes
        self._finalizers: dict[int, weakref.finalize] = {}
        # through the op builder, as DeepSpeed: a handle that cannot be had fails here, naming the op, rather
        # than falling back to torch's pinning unasked
        try:
            from op_builder import PinMemoryBuilder

            self._handle = PinMemoryBuilder().load().pin_handle()
        except Exception as e:
            raise RuntimeError(f"{BACKEND_ENV}=native needs the pin_memory op, which could not be loaded ({e}); "
                               f"unset {BACKEND_ENV} for torch's pinning") from e

    def pin(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """A page-locked tensor of ``tensor``'s dtype and size: its values (``make_copy``), its shape
        (``match_shape``, else 1-D). Its block is freed by :meth:`unpin`, or once it and all its views are gone."""
        numel = tensor.numel()
        root = self._handle.new_cpu_locked_tensor(numel, tensor)
        begin = root.data_ptr()
        locked = root[:numel]  # a view: it and every view of it keep ``root`` alive through ``_base``
        if make_copy:
            locked.copy_(tensor.reshape(-1))
        if match_shape:
            locked = locked.view(tensor.shape)
        self._ranges[begin] = begin + numel * tensor.element_size()
        locked.ds_pinned = True
        locked.ds_pin_base = begin  # what unpin frees, even after ``.data`` is pointed elsewhere
        # tied to ``root``, never passed to the finalizer (that would keep it alive)
        self._finalizers[begin] = weakref.finalize(root, self._release, self._handle, begin, self._ranges,
                                                   self._finalizers)
        return locked

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if getattr(tensor, "ds_pinned", False):
            return True
        if tensor.device.type == "meta" or (_is_fake_tensor is not None and _is_fake_tensor(tensor)):
            return False  # no storage: no address to look up
        address = tensor.data_ptr()
        return any(begin <= address < end for begin, end in self._ranges.items())

    def unpin(self, tensor: torch.Tensor) -> bool:
        """Release the pin of the block ``tensor`` was pinned into (True if it was pinned): its pages are unlocked
        and it leaves ``_ranges`` now. DeepSpeed frees the block here too, so that a tensor still viewing it
        reads freed memory; here the memory itself is freed with the last tensor viewing it (the finalizer),
        so a buffer released under a live view (an optimizer state at ``engine.destroy()``) stays valid."""
        begin = getattr(tensor, "ds_pin_base", None)
        if begin is None:
            begin = tensor.data_ptr()
        self._ranges.pop(begin, None)
        if begin in self._finalizers:
            released = self._handle.unlock_by_ptr(begin)
        else:  # a block this manager did not pin (or already collected): free it as DeepSpeed does
            released = self._handle.free_cpu_locked_tensor_by_ptr(begin)
        if hasattr(tensor, "ds_pinned"):
            tensor.ds_pinned = False
        return released

    @staticmethod
    def _release(handle: PageLockedAllocator, begin: int, ranges: dict, finalizers: dict) -> None:
        ranges.pop(begin, None)
        finalizers.pop(begin, None)
        handle.free_cpu_locked_tensor_by_ptr(begin)


_shared_native_pins: NativePinnedMemory | None = None  # DeepSpeed's name


def get_native_pinned_memory() -> NativePinnedMemory:
    """The process-wide manager (one, so that every component agrees on what is pinned)."""
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def get_active_native_pinned_memory() -> NativePinnedMemory | None:
    """The process-wide manager when ``DS_PIN_MEMORY_BACKEND=native``, else None (torch's pinning)."""
    if os.environ.get(BACKEND_ENV, "torch").strip().lower() != "native":
        return None
    return get_native_pinned_memory()
