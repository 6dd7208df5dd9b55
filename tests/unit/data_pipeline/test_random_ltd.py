"""Random-LTD's token gather/scatter and layer wrapper against dense references (forward and backward)."""
from __future__ import annotations

import pytest
import torch

from dsrun.models.config import GPTConfig
from dsrun.models.gpt import GPT
from dsrun.models.layers import Block
from dsrun.ops.random_ltd import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens
from dsrun.data_efficiency import RandomLayerTokenDrop, remove_random_ltd_state_dict
from dsrun.data_efficiency.data_routing.helper import convert_to_random_ltd

B, S, H, R = 3, 10, 6, 4
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # the same plain-torch ops on both


def dense_reference(hidden: torch.Tensor, kept: torch.Tensor, fn, batch_first: bool) -> torch.Tensor:
    """Row by row with plain indexing: the kept tokens of each row through ``fn``, written back."""
    out = hidden.clone()
    for b in range(kept.size(0)):
        if batch_first:
            out[b, kept[b]] = fn(hidden[b, kept[b]].unsqueeze(0)).squeeze(0)
        else:
            out[kept[b], b] = fn(hidden[kept[b], b].unsqueeze(1)).squeeze(1)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gather_scatter_match_dense_reference_forward_and_backward(batch_first, dtype, device):
    torch.manual_seed(0)
    kept, _ = gpt_sample_tokens(R, S, B, device=device)
    kept = kept[0]
    assert kept.shape == (B, R) and all(row.tolist() == sorted(set(row.tolist())) for row in kept.cpu())
    weight = torch.randn(H, H, dtype=dtype, device=device, requires_grad=True)
    fn = lambda x: torch.tanh(x @ weight) + x  # noqa: E731 - a layer with a residual, like a block
    shape = (B, S, H) if batch_first else (S, B, H)
    base = torch.randn(*shape, dtype=dtype, device=device)
    probe = torch.randn(*shape, dtype=dtype, device=device)
    results = []
    for use_ops in (True, False):
        hidden = base.clone().requires_grad_(True)
        if use_ops:
            passthrough, part = GatherTokens.apply(hidden, kept, batch_first)
            out = ScatterTokens.apply(passthrough, fn(part), kept, batch_first)
        else:
            out = dense_reference(hidden, kept, fn, batch_first)
        grads = torch.autograd.grad((out * probe).sum(), (hidden, weight))
        results.append((out.detach(), *grads))
    for got, want in zip(*results):
        # the same elementwise arithmetic on the same values: equal up to the rounding of the one matmul
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()


def test_bert_sample_tokens_gathers_the_mask_rows_and_columns():
    torch.manual_seed(1)
    mask = torch.randint(0, 2, (B, 1, S, S)).float()
    kept, masks = bert_sample_tokens(R, S, B, layers=2, attn_mask=mask)
    for layer in range(2):
        for b in range(B):
            idx = kept[layer, b]
            assert torch.equal(masks[layer][b, 0], mask[b, 0][idx][:, idx])


class FixedSchedule:
    def __init__(self, kept: int):
        self.kept = kept

    def get_current_seq(self) -> int:
        return self.kept


@pytest.mark.parametrize("device", DEVICES)
def test_random_ltd_block_equals_running_the_block_on_the_kept_tokens_of_each_row(device):
    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=16, n_head=2)).double().to(device)
    wrapped = RandomLayerTokenDrop(block)
    wrapped.init_config({"model_type": "decoder", "hidden_state_order": "batch_seq_dim"}, FixedSchedule(R), 0)
    x = torch.randn(B, S, 16, dtype=torch.float64, device=device)
    probe = torch.randn(B, S, 16, dtype=torch.float64, device=device)
    torch.manual_seed(5)
    x1 = x.clone().requires_grad_(True)
    out = wrapped(x1)
    grads = torch.autograd.grad((out * probe).sum(), [x1, *block.parameters()])
    torch.manual_seed(5)
    kept = gpt_sample_tokens(R, S, B, device=device)[0][0]  # the same draw
    x2 = x.clone().requires_grad_(True)
    ref = dense_reference(x2, kept, block, batch_first=True)
    ref_grads = torch.autograd.grad((ref * probe).sum(), [x2, *block.parameters()])
    assert torch.allclose(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    dropped = torch.ones(B, S, dtype=torch.bool, device=device)
    dropped[torch.arange(B)[:, None], kept] = False
    assert torch.equal(out.detach()[dropped], x[dropped])  # dropped tokens pass through unchanged
    wrapped.eval()
    assert torch.equal(wrapped(x), block(x))               # eval: every token


def test_remove_random_ltd_state_dict_loads_into_the_plain_model():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16)
    plain = GPT(vocab_size=32, block_size=16, n_layer=3, n_head=2, n_embd=16)
    convert_to_random_ltd(model, Block)
    assert all(isinstance(b, RandomLayerTokenDrop) for b in model.transformer["h"])
    assert any(".random_ltd_layer." in k for k in model.state_dict())
    plain.load_state_dict(remove_random_ltd_state_dict(model.state_dict()))
    idx = torch.randint(0, 32, (2, 16))
    model.eval()
    assert torch.equal(plain(idx), model(idx))


class MaskedLayer(torch.nn.Module):
    """Records the mask it gets."""

    def forward(self, hidden, attention_mask=None):
        self.mask = attention_mask
        return hidden * 2


@pytest.mark.parametrize("model_type", ["decoder", "encoder"])
def test_model_mask_name_cuts_the_mask_to_the_kept_tokens(model_type):
    layer = MaskedLayer()
    wrapped = RandomLayerTokenDrop(layer)
    wrapped.init_config({"model_type": model_type, "hidden_state_order": "seq_batch_dim",
                         "model_mask_name": "attention_mask"}, FixedSchedule(R), 0)
    mask = torch.randint(0, 2, (B, 1, S, S)).float()
    x = torch.randn(S, B, H)
    out = wrapped(x, attention_mask=mask)
    assert layer.mask.shape == (B, 1, R, R)
    if model_type == "decoder":  # a causal mask over sorted positions: its leading block
        assert torch.equal(layer.mask, mask[:, :, :R, :R])
    changed = (out != x).any(dim=2)  # [S, B]: exactly R kept tokens per sample were doubled
    assert changed.sum(dim=0).tolist() == [R] * B
