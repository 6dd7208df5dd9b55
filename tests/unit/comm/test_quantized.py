"""The ZeRO++ quantizer (dsrun/comm/quantized.py): the per-element error bound, the message layout and its
byte count, and plain-torch simulations of the quantized collectives (used by tests/integration/
test_zeropp.py to check what the ranks computed)."""
from __future__ import annotations

import pytest
import torch

from dsrun.comm import quantized as q

EPS32 = torch.finfo(torch.float32).eps


def _values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)  # blocks of very different magnitudes
    if n > 40:
        x[10:40] = 0.0  # a run of zeros (a whole block of zeros when block <= 30)
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block", [(1, 16), (15, 16), (1000, 16), (1000, 256), (333, 7)])
def test_error_within_half_a_step_per_element(bits: int, n: int, block: int) -> None:
    x = _values(n)
    codes, scales = q.quantize(x, bits, block)
    assert codes.dtype == torch.int8 and scales.numel() == -(-n // block)
    assert int(codes.abs().max()) <= q.QMAX[bits]
    y = q.dequantize(codes, scales, block)
    per_element = scales.repeat_interleave(block)[:n]
    # |x - q * s| <= s / 2, plus the fp32 rounding of x / s and of q * s
    bound = per_element / 2 + 4 * EPS32 * x.abs()
    assert bool(((x - y).abs() <= bound).all())
    assert bool((y[per_element == 0] == 0).all())  # a block of zeros decodes to zeros exactly


def test_zero_blocks_have_zero_scale() -> None:
    codes, scales = q.quantize(torch.zeros(40), 8, 16)
    assert scales.tolist() == [0.0, 0.0, 0.0] and not codes.any()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 256, 1001])
def test_message_bytes_and_round_trip(bits: int, n: int) -> None:
    x = _values(n, seed=1)
    message = q.encode(x, bits, 64)
    assert message.dtype == torch.uint8
    codes_bytes = n if bits == 8 else (n + 1) // 2  # INT4: two codes per byte, the bytes on the wire are real
    assert message.numel() == q.message_bytes(n, bits, 64) == codes_bytes + 4 * (-(-n // 64))
    codes, scales = q.quantize(x, bits, 64)
    assert torch.equal(q.decode(message, n, bits, 64), q.dequantize(codes, scales, 64))


def test_int4_nibbles_first_element_high() -> None:
    x = torch.tensor([7.0, -7.0, 1.0])  # scale 1: codes 7, -7, 1
    message = q.encode(x, 4, 256)
    assert message[:2].tolist() == [(7 + 8) * 16 + (-7 + 8), (1 + 8) * 16 + 8]
    assert message[2:].clone().view(torch.float32).tolist() == [1.0]


def test_bits_other_than_4_or_8_are_refused() -> None:
    with pytest.raises(ValueError, match="4 or 8"):
        q.quantize(torch.ones(3), 2, 16)


# --- plain-torch simulations of the collectives (every rank in one process) ------------------------------
def simulate_all_gather(shards: list[torch.Tensor], block: int = q.WEIGHT_BLOCK) -> torch.Tensor:
    """What every rank's gathered buffer holds after the quantized all-gather of ``shards`` (fp32)."""
    return torch.cat([q.decode(q.encode(s, 8, block), s.numel(), 8, block) for s in shards])


def simulate_reduce_scatter(rows: list[torch.Tensor], node: int, bits: int = 4,
                            block: int = q.GRAD_BLOCK) -> list[torch.Tensor]:
    """Each rank's output of the quantized reduce-scatter; ``rows[s]`` is rank s's (N, C) input, ``node``
    ranks per node (``node == N``: one stage)."""
    world = len(rows)

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        return q.decode(q.encode(x, bits, block), x.numel(), bits, block).view(x.shape)

    def summed(pieces: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(pieces[0].numel())
        for piece in pieces:
            total += round_trip(piece).reshape(-1)
        return total.view(pieces[0].shape)

    if node >= world:
        return [summed([rows[s][r] for s in range(world)]) for r in range(world)]
    nodes = world // node
    # stage 1: rank (m, l) receives, from each node-mate, the rows of ranks k * node + l for every node k
    partial = {}
    for m in range(nodes):
        for l in range(node):
            mates = [rows[m * node + j].view(nodes, node, -1)[:, l] for j in range(node)]
            partial[m, l] = summed(mates)  # (nodes, C)
    # stage 2: rank (m, l) receives row m of partial[k, l] from every node k
    return [summed([partial[k, r % node][r // node] for k in range(nodes)]) for r in range(world)]


def test_one_stage_simulation_is_within_the_block_bound_of_the_exact_sum() -> None:
    world, c = 3, 500
    rows = [torch.randn(world, c, generator=torch.Generator().manual_seed(s)) for s in range(world)]
    out = simulate_reduce_scatter(rows, node=world, bits=4, block=64)
    for r in range(world):
        exact = sum(rows[s][r].double() for s in range(world))
        bound = sum(q.quantize(rows[s][r], 4, 64)[1].repeat_interleave(64)[:c].double() / 2 for s in range(world))
        assert bool(((out[r].double() - exact).abs() <= bound * (1 + 16 * EPS32) + 16 * EPS32 * exact.abs()).all())


def test_loco_feedback_keeps_each_buckets_error_and_restarts_it() -> None:
    loco = q.LocoFeedback(err_beta=0.0, reset_T=2)
    slabs = torch.linspace(-1, 1, 2 * 300).view(2, 300)
    entry = loco.state(("a",), 1.0)
    plain = torch.stack([q.encode(slabs[p], 4, q.GRAD_BLOCK) for p in range(2)])
    assert torch.equal(loco.encode_with_feedback(entry, "intra", slabs, 4, q.GRAD_BLOCK), plain)  # no error yet
    sent = torch.stack([q.decode(plain[p], 300, 4, q.GRAD_BLOCK) for p in range(2)])
    kept = entry["stages"]["intra"].value(600, slabs.device).view(2, 300)
    # the kept error is this quantization's, stored as INT8: within half an INT8 step of it
    error = slabs - sent
    assert float((kept - error).abs().max()) <= float(error.abs().max()) / 127 / 2 + 1e-7
    assert 0 < loco.nbytes() <= 600 + 4 * 3
    second = loco.encode_with_feedback(loco.state(("a",), 1.0), "intra", slabs, 4, q.GRAD_BLOCK)
    assert not torch.equal(second, plain)  # the error went out with it
    assert loco.state(("a",), 1.0)["stages"] == {}  # the third use restarts (reset_T 2)
    loco = q.LocoFeedback(err_beta=0.5, reset_T=10)
    entry = loco.state(("b",), 1.0)
    loco.encode_with_feedback(entry, "intra", slabs, 4, q.GRAD_BLOCK)
    before = entry["stages"]["intra"].value(600, slabs.device)  # the loss scale grows 4x: so does the error
    assert torch.allclose(loco.state(("b",), 4.0)["stages"]["intra"].value(600, slabs.device), 4 * before)
    loco.encode_with_feedback(entry, "intra", slabs * float("inf"), 4, q.GRAD_BLOCK)  # an overflowing step
    assert entry["stages"]["intra"].codes is None
    with pytest.raises(ValueError, match="err_beta"):
        q.LocoFeedback(err_beta=1.0)
