"""DeepSpeed's Triton ops as torch (``dsrun.ops.triton_ops``): each against its plain formula in float64, with
tolerances from the rounding the dtype allows, and Triton's availability reported honestly."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from dsrun.ops import triton_ops
from dsrun.ops.triton_ops import group_gemm_triton, is_triton_available, swiglu
from dsrun.ops.triton_ops.group_gemm_triton import _GROUP_META_BLOCK, _group_meta

EPS32 = torch.finfo(torch.float32).eps


def _offs(counts):
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _reference(a, b, counts):
    """Per-group ``a_g @ b_g`` in float64, and ``|a_g| @ |b_g|``, the scale of its rounding error."""
    rows = torch.split(a.double(), counts)
    return (torch.cat([r @ b[g].double() for g, r in enumerate(rows)]),
            torch.cat([r.abs() @ b[g].double().abs() for g, r in enumerate(rows)]))


def _within(out, ref, scale, k, dtype):
    """fp32 accumulation of k products (at most k*eps32 of the absolute sum) plus one rounding to ``dtype``."""
    bound = k * EPS32 * scale + torch.finfo(dtype).eps * ref.abs() + torch.finfo(dtype).tiny
    assert bool(((out.double() - ref).abs() <= bound).all()), float(((out.double() - ref).abs() - bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_is_silu_gate_times_up(dtype):
    gate, up = torch.randn(2, 7, 13).to(dtype), torch.randn(2, 7, 13).to(dtype)
    g, u = gate.double(), up.double()
    ref = g * torch.sigmoid(g) * u
    out = swiglu(gate, up)
    assert out.dtype == dtype and out.shape == gate.shape
    # silu evaluated in fp32 (exp, add, divide, multiply: a few fp32 roundings), rounded to dtype, then the product
    # rounded again (each rounding at most eps/2 of the value)
    bound = (torch.finfo(dtype).eps + 4 * EPS32) * ref.abs() + torch.finfo(dtype).tiny
    assert bool(((out.double() - ref).abs() <= bound).all())
    with pytest.raises(ValueError, match="same shape"):
        swiglu(gate, up[..., :5])
    with pytest.raises(ValueError, match="same dtype"):
        swiglu(gate.double(), gate.float())


def test_swiglu_gradients_are_the_formulas():
    gate = torch.randn(64, requires_grad=True)
    up = torch.randn(64, requires_grad=True)
    swiglu(gate, up).backward(torch.ones(64))
    g, u = gate.detach().double(), up.detach().double()
    s = torch.sigmoid(g)
    for got, want in ((gate.grad, u * (s + g * s * (1 - s))), (up.grad, g * s)):
        assert bool(((got.double() - want).abs() <= 16 * EPS32 * (want.abs() + u.abs().max())).all())


def test_group_meta_is_each_groups_first_row_and_size():
    counts = torch.randint(0, 5, (3 * _GROUP_META_BLOCK + 7, ), dtype=torch.int32)
    counts[:3] = torch.tensor([0, 0, 4])
    starts, sizes = _group_meta(torch.cumsum(counts, 0).to(torch.int32))
    assert starts.dtype == sizes.dtype == torch.int32 and torch.equal(sizes, counts)
    assert int(starts[0]) == 0 and torch.equal(starts[1:], torch.cumsum(counts, 0)[:-1].to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_b", [False, True])
def test_group_gemm_is_each_groups_product_with_gradients(dtype, trans_b):
    counts, K, N = [20, 0, 30, 14], 48, 40
    a = torch.randn(sum(counts), K).to(dtype).requires_grad_(True)
    b = torch.randn(len(counts), *((N, K) if trans_b else (K, N))).to(dtype).requires_grad_(True)
    out = group_gemm_triton(a, b, _offs(counts), trans_b=trans_b)
    b_kn = b.detach().transpose(-2, -1) if trans_b else b.detach()
    ref, scale = _reference(a.detach(), b_kn, counts)
    assert out.dtype == dtype and out.shape == (sum(counts), N)
    _within(out.detach(), ref, scale, K, dtype)

    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    # da_g = dout_g @ b_g^T, db_g = a_g^T @ dout_g (in b's own layout with trans_b)
    ref_a, scale_a = _reference(grad_out, b_kn.transpose(-2, -1), counts)
    _within(a.grad, ref_a, scale_a, N, dtype)
    rows, grads = torch.split(a.detach().double(), counts), torch.split(grad_out.double(), counts)
    ref_b = torch.stack([r.T @ d for r, d in zip(rows, grads)])
    scale_b = torch.stack([r.T.abs() @ d.abs() for r, d in zip(rows, grads)])
    if trans_b:
        ref_b, scale_b = ref_b.transpose(-2, -1), scale_b.transpose(-2, -1)
    assert b.grad.shape == b.shape and not b.grad[1].any()  # the empty group's weight gets a zero gradient
    _within(b.grad, ref_b, scale_b, max(counts), dtype)


def test_group_gemm_with_no_rows_and_what_it_refuses():
    w = torch.randn(4, 16, 8, requires_grad=True)
    out = group_gemm_triton(torch.zeros(0, 8, requires_grad=True), w, torch.zeros(4, dtype=torch.int32), trans_b=True)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert w.grad is not None and not w.grad.any()
    a, offs = torch.randn(16, 8), _offs([8, 8])
    with pytest.raises(ValueError, match="contiguous"):
        group_gemm_triton(a, torch.randn(2, 6, 8).transpose(-2, -1), offs)
    with pytest.raises(ValueError, match="share dtype"):
        group_gemm_triton(a, torch.randn(2, 8, 6, dtype=torch.float64), offs)
    with pytest.raises(ValueError, match="Contraction dim"):
        group_gemm_triton(a, torch.randn(2, 7, 6), offs)


def test_triton_is_available_only_where_it_imports_and_finds_a_device(monkeypatch):
    def availability(module):
        monkeypatch.setitem(sys.modules, "triton", module)
        monkeypatch.setitem(sys.modules, "triton.language", types.ModuleType("triton.language"))
        triton_ops._triton_modules.cache_clear()
        return is_triton_available(), triton_ops._TRITON_AVAILABLE, triton_ops.triton

    def triton_with(target):
        module = types.ModuleType("triton")
        module.language = sys.modules.get("triton.language")
        module.runtime = types.SimpleNamespace(driver=types.SimpleNamespace(
            active=types.SimpleNamespace(get_current_target=target)))
        return module

    def no_device():
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    try:
        assert availability(None) == (False, False, None)  # not installed: the import fails
        assert availability(triton_with(no_device))[:2] == (False, False)  # installed, but no GPU driver
        found = triton_with(lambda: "cuda:90")
        assert availability(found) == (True, True, found)
    finally:
        triton_ops._triton_modules.cache_clear()
