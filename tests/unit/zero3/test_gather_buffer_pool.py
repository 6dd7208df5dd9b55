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


def test_a_coalesced_gather_copies_each_parameter_out_of_the_ranks_pieces_and_keeps_its_flat_output() -> None:
    """stage3_allgather_sequential false: rank r's piece of the one all-gather holds its shard of each parameter
    in turn; each parameter's buffer gets its shards in rank order, and the flat output returns to the scratch
    pool for the next fetch of that size."""
    from dsrun.zero.coalesced_gather import _CoalescedWork

    scratch = GatherBufferPool(limit=100)
    flat = torch.arange(12.0)  # 2 ranks x (a shard of 2 of one parameter, then a shard of 4 of another)
    first, second = torch.empty(4), torch.empty(8)
    work = _CoalescedWork(None, flat, 2, [(first, 0, 2), (second, 2, 4)], scratch)
    address = flat.data_ptr()
    del flat
    work.wait()
    work.wait()  # a second parameter's handle asking again changes nothing
    assert first.tolist() == [0, 1, 6, 7] and second.tolist() == [2, 3, 4, 5, 8, 9, 10, 11]
    assert scratch.take(12).data_ptr() == address
