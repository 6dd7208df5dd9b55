"""The ZeRO-3 gather buffer pool keeps a released full-parameter buffer for the next gather of the same size
(no fresh pages to fault in on the CPU), and never one whose memory something else still reads."""
import torch

from dsrun.zero.partition_params import GatherBufferPool


def test_a_released_buffer_is_handed_to_the_next_gather_of_its_size() -> None:
    pool = GatherBufferPool(limit=1 << 20)
    buffer = torch.empty(4096)
    address = buffer.data_ptr()
    pool.give(buffer)
    del buffer
    assert pool.numel == 4096 and pool.nbytes == 4096 * 4
    assert pool.take(1024) is None  # another size: a new buffer
    again = pool.take(4096)
    assert again is not None and again.data_ptr() == address
    assert pool.numel == 0 and pool.take(4096) is None


def test_a_buffer_still_read_through_a_view_or_past_the_limit_is_not_kept() -> None:
    pool = GatherBufferPool(limit=6000)
    buffer = torch.empty(4096)
    saved = buffer[:16].view(4, 4)  # as autograd would keep a view of a gathered weight
    pool.give(buffer)
    assert pool.numel == 0
    del saved
    pool.give(buffer)
    assert pool.numel == 4096
    pool.give(torch.empty(4096))  # 8192 > 6000
    assert pool.numel == 4096


def test_the_pool_holds_what_one_module_gathers_not_the_prefetch_bucket() -> None:
    from torch import nn

    from dsrun.zero.hooks import ParameterCoordinator
    from dsrun.zero.partition_params import partition_param

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    for p in model.parameters():
        partition_param(p)
    model[0].bias.ds_persist = True  # kept gathered: never released, so never in the pool
    coordinator = ParameterCoordinator(model, prefetch_bucket_size=50_000_000)
    # the first Linear's weight (its bias stays gathered), not its 544 elements nor the 50M-element prefetch bucket
    assert coordinator.largest_fetch_numel() == 32 * 16 == coordinator.buffer_pool.limit
    coordinator.remove_hooks()


def test_the_environments_mmap_threshold_stands(monkeypatch) -> None:
    from dsrun.zero import host_memory

    mib = 1 << 20
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host_memory.fix_mmap_threshold(16 * mib) is False  # the environment's own threshold stands
