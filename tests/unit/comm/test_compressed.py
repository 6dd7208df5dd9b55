"""The 1-bit compressed all-reduce (dsrun/comm/compressed.py) against a plain-torch simulation of the
algorithm run for all ranks in one process: the decoded result, the server signs and scales, and both error
buffers, over several calls (so the error feedback is exercised), for 2, 3 and 4 ranks and lengths that are
not multiples of 8 x world size. The wire bytes are checked against the layout's formula."""
from __future__ import annotations


import pytest
import torch

from dsrun.comm.compressed import (CompressedLayout, check_backend_name, merge_server_errors, pack_signs,
                                   split_server_error, unpack_signs, wire_ratio)
from dsrun.utils.errors import ConfigError
from tests.harness.launch import Launch

# (numel, chunk or None, block): awkward lengths, blocks that do not divide the chunk, a ZeRO-1 style chunk
CASES = [(1, None, 2048), (7, None, 2048), (13, None, 4), (1001, None, 2048), (1001, None, 37), (4099, None, 512),
         (50, 30, 7)]  # chunk 30: at 3-4 ranks the last chunks hold only padding
CALLS = 3


def _inputs(world: int, numel: int, call: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * world + 10 * numel + call)
    return [torch.randn(numel, generator=gen) * (1 + r) for r in range(world)]


def _compress(values: torch.Tensor, real: int, block: int) -> tuple[torch.Tensor, list[float]]:
    """Signs (+1 for >= 0) times the RMS of each block's real elements (summed in fp32 over the block, as a
    float32 run does); padding decodes to 0."""
    chunk = values.numel()
    decoded = torch.zeros(chunk)
    scales = []
    for start in range(0, chunk, block):
        piece = torch.zeros(block)
        count = max(0, min(start + block, real) - start)
        piece[:count] = values[start:start + count]
        scale = (piece.square().sum() / max(count, 1)).sqrt()
        scales.append(float(scale))
        decoded[start:start + count] = torch.where(values[start:start + count] >= 0, scale, -scale)
    return decoded, scales


def simulate(xs, worker_errors, server_errors, layout: CompressedLayout):
    """One call for every rank at once: returns (result, server scales per rank, new worker errors, new
    server errors)."""
    world, chunk, numel = layout.world_size, layout.chunk, layout.numel
    sent = []
    new_worker = []
    for x, e in zip(xs, worker_errors):
        y = torch.zeros(world * chunk)
        y[:numel] = x + e
        pieces = []
        for r in range(world):
            decoded, scales = _compress(y[r * chunk:(r + 1) * chunk], layout.valid(r), layout.block)
            pieces.append((torch.where(y[r * chunk:(r + 1) * chunk] >= 0, 1.0, -1.0), scales, decoded))
        new_worker.append(y[:numel] - torch.cat([p[2] for p in pieces])[:numel])
        sent.append(pieces)
    result = torch.zeros(world * chunk)
    server_scales, new_server = [], []
    for r in range(world):
        copies = []
        for j in range(world):
            signs, scales, _ = sent[j][r]
            expanded = torch.tensor(scales).repeat_interleave(layout.block)[:chunk] / world
            copies.append(signs * expanded)
        valid = (torch.arange(chunk) < layout.valid(r)).float()
        z = torch.stack(copies).sum(dim=0) * valid + server_errors[r]
        decoded, scales = _compress(z, layout.valid(r), layout.block)
        new_server.append(z - decoded)
        server_scales.append(scales)
        result[r * chunk:(r + 1) * chunk] = decoded
    return result[:numel], server_scales, new_worker, new_server


WORLDS = (2, 3, 4)


def _rank_run(rank: int, world_size: int) -> dict:
    """One 4-rank launch serves every world size: groups of the first 2, 3 and 4 ranks."""
    from dsrun import comm
    from dsrun.comm.compressed import CompressedAllreduce

    comm.init_distributed(verbose=False)
    out: dict[int, list] = {}
    for world in WORLDS:
        group = comm.new_group(list(range(world)))  # every rank takes part in creating it
        if rank >= world:
            continue
        out[world] = []
        for numel, chunk, block in CASES:
            layout = CompressedLayout.of(numel, world, chunk, block)
            engine = CompressedAllreduce(layout, group=group)
            worker_error, server_error = torch.zeros(numel), torch.zeros(layout.chunk)
            for call in range(CALLS):
                comm.reset_comms_stats()
                result = engine(_inputs(world, numel, call)[rank], worker_error, server_error)
                traffic = sum(s["traffic_bytes"] for s in comm.get_comms_stats().values())
                _, scales = engine._unpack(result.messages)
                tensors = (result.decode(), result.own_chunk, scales, worker_error, server_error)
                out[world].append((*(t.tolist() for t in tensors), traffic))  # lists: picklable
    comm.barrier()
    comm.destroy_process_group()
    return out


def collect(runs) -> list[dict]:
    return runs(Launch(_rank_run, max(WORLDS), timeout=240))


@pytest.mark.parametrize("world", WORLDS)
def test_compressed_allreduce_equals_the_simulation(world: int, runs: list[dict]) -> None:
    index = 0
    for numel, chunk, block in CASES:
        layout = CompressedLayout.of(numel, world, chunk, block)
        worker = [torch.zeros(numel) for _ in range(world)]
        server = [torch.zeros(layout.chunk) for _ in range(world)]
        for call in range(CALLS):
            expected, server_scales, worker, server = simulate(_inputs(world, numel, call), worker, server, layout)
            for r in range(world):
                *tensors, traffic = runs[r][world][index]
                result, own, scales, w_err, s_err = (torch.tensor(t) for t in tensors)
                case = f"world {world}, numel {numel}, chunk {chunk}, block {block}, call {call}, rank {r}"
                lo = r * layout.chunk
                own_expected = torch.zeros(layout.chunk)
                own_expected[:layout.valid(r)] = expected[lo:lo + layout.valid(r)]
                torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6, msg=case)
                torch.testing.assert_close(own, own_expected, rtol=1e-6, atol=1e-6, msg=case)
                torch.testing.assert_close(scales, torch.tensor(server_scales), rtol=1e-6, atol=1e-6, msg=case)
                torch.testing.assert_close(w_err, worker[r], rtol=1e-6, atol=1e-6, msg=case)
                torch.testing.assert_close(s_err, server[r], rtol=1e-6, atol=1e-6, msg=case)
                assert traffic == layout.traffic_bytes() == 2 * (world - 1) * layout.message_bytes, case
            index += 1


def test_sign_bits_round_trip_for_any_length() -> None:
    values = torch.tensor([[0.0, -0.0, 1.0, -2.0, 3.0, -1e-30, 5.0, 6.0, -7.0, 8.0, -9.0]])
    packed = pack_signs(values)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 2)  # 11 signs in 2 bytes
    # 0.0 and -0.0 are ">= 0": sent as +1, as DeepSpeed sends a zero's sign
    assert unpack_signs(packed, 11).tolist() == [[1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1]]


def test_layout_bytes_and_the_wire_ratio() -> None:
    layout = CompressedLayout.of(1_000_000, 2)
    assert layout.chunk == 500_000 and layout.sign_bytes == 62_500 and layout.blocks == 245
    assert layout.message_bytes == 62_500 + 4 * 245
    assert wire_ratio(layout) < 1 / 31  # 1 bit + 32 bits per 2048 elements, against 32 bits
    with pytest.raises(ValueError):
        CompressedLayout.of(10, 2, chunk=4)  # 2 chunks of 4 cannot hold 10 elements


def test_server_errors_are_recut_for_another_world_size() -> None:
    old = CompressedLayout.of(10, 3)  # chunks of 4: 4 + 4 + 2 real elements
    pieces = [torch.arange(4.0), torch.arange(4.0, 8.0), torch.tensor([8.0, 9.0, 0.0, 0.0])]
    full = merge_server_errors(pieces, old.numel)
    assert full.tolist() == [float(i) for i in range(10)]
    new = CompressedLayout.of(10, 4)  # chunks of 3: the last one holds 1 real element
    assert [split_server_error(full, new, r).tolist() for r in range(4)] == [
        [0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0, 0.0, 0.0]]


def test_backend_names_are_deepspeeds() -> None:
    assert [check_backend_name(n) for n in ("nccl", "mpi", "compressed", "hccl", "NCCL")] == [
        "nccl", "mpi", "compressed", "hccl", "nccl"]
    with pytest.raises(ConfigError, match="comm_backend_name: got 'gloo'; allowed: nccl, mpi, compressed, hccl"):
        check_backend_name("gloo")
