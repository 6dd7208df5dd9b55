"""The self-describing header every pipeline message carries."""
from __future__ import annotations

import pytest
import torch

from dsrun.pipe import p2p


def test_header_round_trip_keeps_dtypes_shapes_grad_flags_and_missing_entries() -> None:
    value = (torch.randn(2, 5, 3, requires_grad=True), torch.arange(7), None, torch.ones(4, dtype=torch.bool),
             torch.zeros(2, 1, dtype=torch.bfloat16))
    header = p2p.encode_header(p2p.GRAD, 9, value, torch.device("cpu"))
    assert header.shape == (p2p.HEADER_LEN,) and header.dtype == torch.int64
    kind, micro_batch, single, specs = p2p.decode_header(header)
    assert (kind, micro_batch, single) == (p2p.GRAD, 9, False)
    assert specs == [(torch.float32, (2, 5, 3), True), (torch.int64, (7,), False), None,
                     (torch.bool, (4,), False), (torch.bfloat16, (2, 1), False)]
    assert p2p.decode_header(p2p.encode_header(p2p.ACTIVATION, 0, torch.zeros(3), torch.device("cpu")))[2] is True


def test_header_refuses_what_it_cannot_describe() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="at most 16 tensors"):
        p2p.encode_header(p2p.ACTIVATION, 0, tuple(torch.zeros(1) for _ in range(17)), cpu)
    with pytest.raises(ValueError, match="dims"):
        p2p.encode_header(p2p.ACTIVATION, 0, torch.zeros([1] * 9), cpu)
    with pytest.raises(TypeError, match="item 1 is int"):
        p2p.encode_header(p2p.ACTIVATION, 0, (torch.zeros(1), 3), cpu)
    with pytest.raises(RuntimeError, match="out of step"):
        p2p.decode_header(torch.zeros(p2p.HEADER_LEN, dtype=torch.int64))


def test_split_cuts_and_pads_a_payload() -> None:
    split = p2p.Split(group=None, size=3, rank=2)
    assert split.piece(7) == 3
    assert split.cut(torch.arange(7.0)).tolist() == [6.0, 0.0, 0.0]
