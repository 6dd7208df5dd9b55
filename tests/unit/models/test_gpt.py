"""The built-in GPT: call convention, initial loss, tying, positions, activation checkpointing."""
from __future__ import annotations

import math

import pytest
import torch

from dsrun.models import GPT, GPTConfig, num_parameters
from dsrun.models.layers import apply_rotary, rotary_cos_sin
from dsrun.utils.errors import ConfigError, UserError

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)


def _batch(vocab: int = 64, batch: int = 3, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_logits_shape_and_the_batch_call_conventions_agree():
    torch.manual_seed(0)
    model = GPT(**TINY)
    inputs, targets = _batch()
    logits = model(inputs)
    assert logits.shape == (3, 16, 64)
    loss = model(inputs, targets)
    assert loss.ndim == 0
    # An engine may call model(batch) or model(*batch): both are the loss.
    assert torch.equal(model((inputs, targets)), loss)
    assert torch.equal(model([inputs, targets]), loss)
    both_loss, both_logits = model(inputs, targets, return_logits=True)
    assert torch.equal(both_loss, loss) and torch.equal(both_logits, logits)


def test_initial_loss_is_log_vocab():
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=64, n_layer=3, n_head=4, n_embd=96)
    inputs, targets = _batch(vocab=256, batch=8, seq=64)
    assert model(inputs, targets).item() == pytest.approx(math.log(256), abs=0.05)


def test_ignore_index_positions_do_not_count():
    torch.manual_seed(0)
    model = GPT(**TINY)
    inputs, targets = _batch()
    masked = targets.clone()
    masked[:, 8:] = -100
    expected = model(inputs[:, :8], targets[:, :8])  # causal: the first 8 logits do not see the rest
    assert model(inputs, masked).item() == pytest.approx(expected.item(), rel=1e-5)


def test_tied_embeddings_share_storage_and_count_once():
    tied = GPT(**TINY)
    assert tied.lm_head.weight is tied.transformer["wte"].weight
    assert tied.lm_head.weight.data_ptr() == tied.transformer["wte"].weight.data_ptr()
    untied = GPT(**TINY, tie_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.transformer["wte"].weight.data_ptr()
    vocab_by_width = TINY["vocab_size"] * TINY["n_embd"]
    assert num_parameters(untied) - num_parameters(tied) == vocab_by_width
    assert num_parameters(tied) == tied.config.num_parameters()
    assert num_parameters(untied) == untied.config.num_parameters()
    # A step moves the shared weight once, through both uses.
    inputs, targets = _batch()
    tied(inputs, targets).backward()
    assert tied.lm_head.weight.grad is tied.transformer["wte"].weight.grad


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=256)
    block = model.transformer["h"][0]
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    expected = 0.02 / math.sqrt(2 * 8)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert torch.count_nonzero(block.mlp.c_fc.bias) == 0


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_both_position_kinds_learn_a_toy_sequence(positions):
    torch.manual_seed(0)
    model = GPT(vocab_size=16, block_size=48, n_layer=2, n_head=2, n_embd=32, positions=positions)
    assert ("wpe" in model.transformer) == (positions == "learned")
    pattern = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8] * 3)
    inputs, targets = pattern[:-1].unsqueeze(0).repeat(4, 1), pattern[1:].unsqueeze(0).repeat(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        loss = model(inputs, targets)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first == pytest.approx(math.log(16), abs=0.2)
    assert loss.item() < 0.3 * first


def test_rotary_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    head = 8
    q, k = torch.randn(1, 1, 1, head), torch.randn(1, 1, 1, head)
    cos, sin = rotary_cos_sin(20, head, 10000.0, torch.device("cpu"), torch.float32)

    def score(m: int, n: int) -> float:
        return (apply_rotary(q, cos[m], sin[m]) * apply_rotary(k, cos[n], sin[n])).sum().item()

    assert score(5, 2) == pytest.approx(score(15, 12), rel=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_gives_identical_gradients(dropout):
    inputs, targets = _batch()
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(**TINY, dropout=dropout, activation_checkpointing=checkpointing)
        torch.manual_seed(1)  # the same dropout masks in both runs
        model(inputs, targets).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0, msg=name)


def test_activation_checkpointing_calls_the_checkpoint_function_per_block():
    model = GPT(**TINY)
    calls = []

    def counting_checkpoint(block, hidden):
        calls.append(block)
        return torch.utils.checkpoint.checkpoint(block, hidden, use_reentrant=False)

    model.enable_activation_checkpointing(checkpoint_fn=counting_checkpoint)
    model(*_batch()).backward()
    assert calls == list(model.transformer["h"])
    model.eval()
    model(_batch()[0])  # no checkpointing outside training
    assert len(calls) == TINY["n_layer"]


def test_sequence_longer_than_block_size_is_a_user_error():
    model = GPT(**TINY)
    with pytest.raises(UserError, match="block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_config_mistakes_are_one_line_errors_with_suggestions():
    with pytest.raises(ConfigError, match=r"model\.n_layers.*did you mean 'n_layer'"):
        GPT(**TINY, n_layers=3)
    with pytest.raises(ConfigError, match="not divisible by n_head"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ConfigError, match="did you mean 'rotary'"):
        GPTConfig(positions="rotery")


def test_generate_extends_the_context():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=5, temperature=0)
    assert out.shape == (2, 8)
    assert torch.equal(out, model.generate(torch.zeros(2, 3, dtype=torch.long), 5, temperature=0))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("positions", ["learned", "rotary"])
@pytest.mark.parametrize("tied", [True, False])
def test_analytic_counts_match_every_option_combination(bias, positions, tied):
    from dsrun.models import largest_layer_params

    with torch.device("meta"):
        model = GPT(**TINY, bias=bias, positions=positions, tie_embeddings=tied)
    assert num_parameters(model) == model.config.num_parameters()
    assert num_parameters(model, exclude_embeddings=True) == model.config.num_parameters(exclude_embeddings=True)
    assert largest_layer_params(model) == model.config.largest_layer_params()


def test_bfloat16_forward_and_backward():
    torch.manual_seed(0)
    model = GPT(**TINY, positions="rotary").to(torch.bfloat16)
    loss = model(*_batch())
    assert loss.dtype == torch.float32  # the loss is computed in fp32
    loss.backward()
    assert model.transformer["wte"].weight.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(math.log(64), abs=0.1)
