"""The memory-efficient linear: same results as F.linear, and no saved view of a ZeRO-3 weight."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsrun.zero import host_memory
from dsrun.zero.linear import zero3_linear
from dsrun.zero.partition_params import gather_params, partition_param, release_param


def test_gradients_match_f_linear() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, requires_grad=True)
    lin = nn.Linear(5, 4)
    ref = F.linear(x, lin.weight, lin.bias)
    ref.square().sum().backward()
    expected = (x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone())
    x.grad = lin.weight.grad = lin.bias.grad = None
    full = lin.weight.detach().clone()
    partition_param(lin.weight)
    gather_params([lin.weight])
    out = zero3_linear(x, lin.weight, lin.bias)
    release_param(lin.weight)  # as after the module's forward
    gather_params([lin.weight])  # as the backward pre-hook does
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    for got, want in zip((x.grad, lin.weight.grad, lin.bias.grad), expected):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(lin.weight.data, full)


def test_no_saved_tensor_shares_the_gathered_weight() -> None:
    lin = nn.Linear(5, 4)
    partition_param(lin.weight)
    gather_params([lin.weight])
    storage = lin.weight.data.untyped_storage().data_ptr()
    sharing = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t is not lin.weight and t.untyped_storage().data_ptr() == storage:
            sharing.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        zero3_linear(torch.randn(2, 5, requires_grad=True), lin.weight, lin.bias)
        assert sharing == []  # releasing the parameter really frees its full buffer
        torch._C._nn.linear(torch.randn(2, 5, requires_grad=True), lin.weight, lin.bias)
        assert sharing  # plain F.linear keeps weight.t(), a view of it


def test_host_memory_controls_are_available_on_glibc() -> None:
    assert host_memory.fix_mmap_threshold() and host_memory.trim() in (True, False)
