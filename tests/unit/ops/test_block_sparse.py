"""Block-sparse attention equals dense attention with the same mask, and its memory does not grow with seq².

References are dense attention written out in float64 (scores, -inf outside the layout, softmax, context).
Tolerances: in float64 the two differ only by rounding; in float32 each score is a head_dim-term dot product
and each output a sum over at most ``seq`` keys, so the error is bounded by a few units of fp32 rounding of
those sums (see ``rounding_bound``). On a CUDA machine every test also runs on the GPU.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from dsrun.ops.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                                        FixedSparsityConfig, VariableSparsityConfig, block_index,
                                        block_sparse_attention)
from dsrun.profiling.tensor_memory import TensorMemoryTracker

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LAYOUTS = {
    "fixed": lambda h: FixedSparsityConfig(h, block=8, num_local_blocks=2),
    "bigbird per head": lambda h: BigBirdSparsityConfig(h, block=8, different_layout_per_head=True),
    "bslongformer": lambda h: BSLongformerSparsityConfig(h, block=8, global_block_indices=[1]),
    "variable": lambda h: VariableSparsityConfig(h, block=8, num_random_blocks=1, local_window_blocks=[1, 3]),
}


def element_mask(layout: torch.Tensor, block: int, causal: bool) -> torch.Tensor:
    """The layout expanded to one boolean per (head, query, key)."""
    mask = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)
    return mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril() if causal else mask


def dense_reference(q, k, v, mask, rpe=None, key_padding=None, attn_mask=None, dropout_keep=None, p=0.0):
    """softmax(q kᵀ/√d + rpe + key_padding (added) + attn_mask (0 -> -inf), -inf outside ``mask``) v."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if rpe is not None:
        scores = scores + rpe
    if key_padding is not None:
        scores = scores + key_padding[:, None, None, :]
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask == 0, float("-inf"))
    scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with nothing to attend to outputs zeros
    return probs @ v


def rounding_bound(q, k, v, keys: int, dtype: torch.dtype) -> float:
    """First-order bound on |out_dtype - out_exact|: the scores' dot products are off by at most
    head_dim·u·Σ|q||k|·scale; softmax turns a score error δ into a relative error of at most 2δ on the
    probabilities, and the context sums ``keys`` terms of at most max|v| each (u = unit roundoff of dtype)."""
    u = torch.finfo(dtype).eps / 2
    q, k, v = q.detach(), k.detach(), v.detach()
    d = q.shape[-1]
    score_error = d * u * float((q.abs() @ k.abs().transpose(-1, -2)).max()) * d ** -0.5
    return 4 * float(v.abs().max()) * (2 * score_error + 2 * keys * u)


def qkv(shape, dtype=torch.float64, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=dtype).to(device).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sparse_equals_dense_with_the_same_mask_forward_and_backward(name, causal, device):
    random.seed(0)
    batch, heads, seq, block = 2, 3, 64, 8
    layout = LAYOUTS[name](heads).make_layout(seq)
    q, k, v = qkv((batch, heads, seq, 16), device=device)
    out = block_sparse_attention(q, k, v, block_index(layout, block, causal, device), causal=causal)
    ref = dense_reference(q, k, v, element_mask(layout, block, causal))
    bound = rounding_bound(q, k, v, seq, torch.float64)
    assert (out - ref).abs().max() <= bound
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        assert (got - want).abs().max() <= bound * float(grad.abs().max()) * seq


@pytest.mark.parametrize("device", DEVICES)
def test_masks_and_relative_positions_follow_deepspeeds_softmax(device):
    """scale, then rpe added, then the key padding mask added ("add") and the attention mask zero -> -inf
    ("mul"), each only where the layout has blocks; fully masked rows output zeros."""
    random.seed(0)
    batch, heads, seq, block = 2, 2, 32, 8
    layout = BigBirdSparsityConfig(heads, block=block, num_random_blocks=1).make_layout(seq)
    q, k, v = qkv((batch, heads, seq, 8), device=device)
    rpe = torch.randn(heads, seq, seq, dtype=torch.float64, device=device)
    key_padding = torch.zeros(batch, seq, dtype=torch.float64, device=device)
    key_padding[0, -5:] = -1e4
    key_padding[1, 3] = float("-inf")
    attn_mask = (torch.rand(seq, seq, generator=torch.Generator().manual_seed(1)) > 0.3).double().to(device)
    attn_mask[7] = 0  # query 7 sees nothing
    out = block_sparse_attention(q, k, v, block_index(layout, block, device=device), rpe=rpe,
                                 key_padding_mask=key_padding, attn_mask=attn_mask)
    ref = dense_reference(q, k, v, element_mask(layout, block, False), rpe, key_padding, attn_mask)
    assert (out - ref).abs().max() <= rounding_bound(q, k, v, seq, torch.float64) * (1 + float(rpe.abs().max()))
    assert torch.equal(out[:, :, 7], torch.zeros_like(out[:, :, 7]))
    # "mul" key padding and "add" attention mask: the same masks written the other way round
    out2 = block_sparse_attention(q, k, v, block_index(layout, block, device=device), rpe=rpe,
                                  key_padding_mask=(key_padding == 0).double(), key_padding_mask_mode="mul",
                                  attn_mask=torch.where(attn_mask == 0, float("-inf"), 0.0), attn_mask_mode="add")
    hard = dense_reference(q, k, v, element_mask(layout, block, False), rpe,
                           torch.where(key_padding == 0, 0.0, float("-inf")), attn_mask)
    assert (out2 - hard).abs().max() <= rounding_bound(q, k, v, seq, torch.float64) * (1 + float(rpe.abs().max()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_is_within_its_rounding_of_the_exact_result(dtype, device):
    random.seed(0)
    batch, heads, seq, block = 2, 4, 128, 16
    layout = FixedSparsityConfig(heads, block=block).make_layout(seq)
    q, k, v = qkv((batch, heads, seq, 32), dtype=dtype, device=device)
    out = block_sparse_attention(q, k, v, block_index(layout, block, True, device), causal=True)
    exact = dense_reference(q.double(), k.double(), v.double(), element_mask(layout, block, True))
    assert out.dtype == dtype
    # inputs are exactly representable in both; rounding happens in the scores, probabilities and output
    assert (out.double() - exact).abs().max() <= rounding_bound(q.double(), k.double(), v.double(), seq, dtype) + \
        float(exact.detach().abs().max()) * torch.finfo(dtype).eps


def test_dropout_gradients_are_exact_for_the_masks_drawn():
    """gradcheck re-runs forward with the same seed, so every run draws the same masks; backward draws them
    again from the seeded generator instead of keeping them."""
    q, k, v = qkv((1, 2, 16, 2))
    index = block_index(FixedSparsityConfig(2, block=4, num_local_blocks=2).make_layout(16), 4, causal=True)

    def attend(q, k, v):
        torch.manual_seed(3)
        return block_sparse_attention(q, k, v, index, causal=True, dropout_p=0.3)

    assert torch.autograd.gradcheck(attend, (q, k, v), fast_mode=True)
    torch.manual_seed(4)
    other = block_sparse_attention(q, k, v, index, causal=True, dropout_p=0.3)
    assert not torch.allclose(other, attend(q, k, v))


def test_invalid_inputs_name_the_problem():
    index = block_index(DenseSparsityConfig(2, block=8).make_layout(32), 8)
    q = torch.zeros(1, 2, 32, 4)
    with pytest.raises(ValueError, match="2 heads x 32 tokens"):
        block_sparse_attention(q[:, :, :24], q[:, :, :24], q[:, :, :24], index)
    with pytest.raises(ValueError, match="attn_mask_mode: got 'sub'"):
        block_sparse_attention(q, q, q, index, attn_mask_mode="sub")
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        block_sparse_attention(q, q, q, index, key_padding_mask=torch.zeros(32))


def peak_bytes(fn, *tensors) -> int:
    """Peak tensor bytes while running ``fn`` forward and backward (the inputs' own storage excluded)."""
    with TensorMemoryTracker() as memory:
        fn(*tensors).sum().backward()
    return memory.peak


def test_memory_at_4096_tokens_and_under_10_percent_density_is_below_an_eighth_of_dense():
    """Dense attention with the same mask holds seq² scores (and probabilities) per head; the block-sparse
    path holds the output, one log-sum-exp per query and a chunk bounded by the size of Q."""
    seq, block, head_dim = 4096, 64, 64
    layout = BSLongformerSparsityConfig(1, block=block, num_sliding_window_blocks=3).make_layout(seq)
    assert float(layout.float().mean()) <= 0.10
    q, k, v = (torch.randn(1, 1, seq, head_dim, requires_grad=True) for _ in range(3))
    index = block_index(layout, block)
    sparse = peak_bytes(lambda q, k, v: block_sparse_attention(q, k, v, index), q, k, v)
    mask = element_mask(layout, block, False)
    dense = peak_bytes(lambda q, k, v: dense_reference(q, k, v, mask), q, k, v)
    assert dense >= seq * seq * 4  # at least one fp32 score matrix
    assert sparse * 8 <= dense, (sparse, dense)


def test_memory_grows_with_the_nonzero_blocks_not_with_seq_squared():
    """A sliding window has a fixed number of blocks per row: doubling the sequence doubles the blocks, and
    the peak memory doubles too (it would quadruple if anything seq² were allocated)."""
    peaks = []
    for seq in (2048, 4096):
        layout = BSLongformerSparsityConfig(1, block=32, num_sliding_window_blocks=3,
                                            global_block_indices=[]).make_layout(seq)
        q, k, v = (torch.randn(1, 1, seq, 32, requires_grad=True) for _ in range(3))
        index = block_index(layout, 32)
        peaks.append(peak_bytes(lambda q, k, v: block_sparse_attention(q, k, v, index), q, k, v))
    assert peaks[1] <= 2.1 * peaks[0], peaks


@pytest.mark.parametrize("device", DEVICES)
def test_dense_layout_in_causal_mode_equals_torch_sdpa(device):
    q, k, v = qkv((2, 2, 48, 8), dtype=torch.float32, device=device)
    layout = DenseSparsityConfig(2, block=16).make_layout(48)
    out = block_sparse_attention(q, k, v, block_index(layout, 16, True, device), causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out - ref).abs().max() <= 2 * rounding_bound(q, k, v, 48, torch.float32)
