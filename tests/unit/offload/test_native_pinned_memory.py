"""DeepSpeed's native pinned memory (``DS_PIN_MEMORY_BACKEND=native``): page-locked blocks, the manager's
bookkeeping, the offloaded optimizer's host buffers pinned by it and released at ``engine.destroy()``."""
from __future__ import annotations

import gc
import mmap

import pytest
import torch

import dsrun
from dsrun.utils.pin_memory import NativePinnedMemory, get_active_native_pinned_memory, pin_handle

PAGE = mmap.PAGESIZE


def _locked_kib() -> int:
    """The kernel's count of this process's page-locked memory (``VmLck``, kB)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmLck:"))


def test_blocks_are_page_aligned_locked_and_unlocked_by_the_kernel():
    handle = pin_handle()
    before = _locked_kib()
    block = handle.new_cpu_locked_tensor(4 * PAGE // 4, torch.empty(0, dtype=torch.float32))  # 4 pages
    assert block.data_ptr() % PAGE == 0 and block.shape == (PAGE, ) and block._base is None
    assert _locked_kib() - before == 4 * PAGE // 1024  # mlock reached the kernel
    assert handle.is_pinned(block[PAGE // 2:]) and not handle.is_pinned(torch.empty(PAGE))
    assert handle.free_cpu_locked_tensor(block) is True and _locked_kib() == before
    assert not handle.free_cpu_locked_tensor_by_ptr(block.data_ptr())  # freed once


def test_manager_pins_copies_tracks_views_and_frees_with_the_last_view():
    pins = NativePinnedMemory()
    source = torch.arange(2 * PAGE // 4, dtype=torch.float32).reshape(2, -1)  # 2 pages
    before = _locked_kib()
    pinned = pins.pin(source)
    begin = pinned.data_ptr()
    assert torch.equal(pinned, source) and pinned.ds_pinned and pins._ranges[begin] == begin + 2 * PAGE
    view = pinned.reshape(-1)[8:16]
    assert not getattr(view, "ds_pinned", False) and pins.is_pinned(view)
    assert pins.pin(source, match_shape=False).shape == (source.numel(), )
    del pinned
    gc.collect()
    assert begin in pins._ranges and float(view[0]) == 8.0  # the view keeps the block
    del view
    gc.collect()
    assert begin not in pins._ranges
    fake = torch.zeros(2, device="meta")
    assert pins.is_pinned(fake) is False
    gc.collect()
    assert _locked_kib() == before


def test_unpin_releases_the_lock_at_once_and_the_memory_with_the_last_view():
    pins = NativePinnedMemory()
    before = _locked_kib()
    pinned = pins.pin(torch.ones(PAGE // 4))
    begin, view = pinned.data_ptr(), pinned[:4]
    pinned.data = torch.zeros(3)  # offload/reload redirect .data: unpin still releases the pinned block
    assert pins.unpin(pinned) is True and begin not in pins._ranges and not pins.is_pinned(view)
    assert _locked_kib() == before and torch.equal(view, torch.ones(4))  # unlocked, still readable
    del view, pinned
    gc.collect()
    assert begin not in pin_handle()._blocks  # freed with its last view


def test_accelerator_routes_through_the_manager_only_when_native(monkeypatch):
    accelerator = dsrun.get_accelerator()
    tensor = torch.ones(4)
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    assert get_active_native_pinned_memory() is None and accelerator.unpin_memory(tensor) is None
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    pinned = accelerator.pin_memory(tensor)
    assert pinned is not tensor and accelerator.is_pinned(pinned) and not accelerator.is_pinned(tensor)
    assert accelerator.unpin_memory(pinned) is True and not accelerator.is_pinned(pinned)


def test_native_backend_fails_naming_the_op_when_it_cannot_load(monkeypatch):
    """The manager takes its handle from the op builder, as DeepSpeed's does: a load that fails is a RuntimeError
    naming the op, never a quiet fall back to torch's pinning."""
    import op_builder
    import dsrun.utils.pin_memory as pin_memory

    class FailingBuilder:
        def load(self):
            raise OSError("no libc here")

    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    monkeypatch.setattr(pin_memory, "_shared_native_pins", None)
    monkeypatch.setattr(op_builder, "PinMemoryBuilder", FailingBuilder)
    with pytest.raises(RuntimeError, match="pin_memory op.*no libc here"):
        get_active_native_pinned_memory()
    assert pin_memory._shared_native_pins is None  # nothing half-built is kept


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_optimizer_buffers_are_natively_pinned_and_released_at_destroy(stage, monkeypatch, world_of_one):
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    pins = get_active_native_pinned_memory()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    engine = dsrun.initialize(model=model, config=config)[0]
    store = engine.strategy.store if stage < 3 else engine.strategy.placement.offloaded
    assert len(store.host.native) == len(pins._ranges) > 0  # masters, gradients (and 16-bit staging if any)
    assert all(pins.is_pinned(buffer) for buffer in store.host.native)
    loss = engine(torch.randn(4, 16)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.destroy()
    assert len(pins._ranges) == 0
