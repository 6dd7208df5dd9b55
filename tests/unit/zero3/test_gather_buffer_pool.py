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
