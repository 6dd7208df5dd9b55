"""``model.activation_checkpointing: none | full | every_N | selective`` on an 8-layer GPT, measured exactly.

Saved-activation bytes are what autograd (and the checkpoints, which keep everything through
``save_for_backward``) hold between forward and backward, counted with saved-tensor hooks as distinct
non-parameter storages. Recompute FLOPs are torch's ``FlopCounterMode`` over forward + backward, minus the
same count without checkpointing; its CPU attention kernel has no formula in torch, so the test gives it the
one torch uses for the CUDA kernels (two ``T x T x head`` matmuls forward, five backward), so that
recomputing attention would count.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dsrun.estimate.activations import gpt_activation_bytes, gpt_block_activation_bytes, gpt_selective_kept_bytes
from dsrun.estimate.inputs import GPTShape
from dsrun.models import GPT, GPTConfig
from dsrun.models.accounting import recompute_flops
from dsrun.utils.errors import ConfigError

SHAPE = dict(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128)
BATCH, SEQ = 2, 64
MODES = ("none", "full", "every_2", "selective")


def _attention_flops(query: torch.Size, key: torch.Size, matmuls: int) -> int:  # the counter passes shapes
    batch, heads, seq_q, head = query
    return 2 * matmuls * batch * heads * seq_q * key[-2] * head


def _cpu_attention(query, key, *args, **kwargs) -> int:
    return _attention_flops(query, key, 2)  # Q K^T and P V


def _cpu_attention_backward(grad_out, query, key, *args, **kwargs) -> int:
    return _attention_flops(query, key, 5)  # recompute Q K^T, then dV, dP, dQ, dK


CPU_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward}


def _measure(mode: str, dropout: float = 0.0) -> dict:
    torch.manual_seed(0)
    model = GPT(**SHAPE, dropout=dropout, activation_checkpointing=mode)
    idx = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(2)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as flops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, idx)
        loss.backward()
    return {"saved": sum(storages.values()), "flops": flops.get_total_flops(),
            "grads": [p.grad for p in model.parameters()]}


@pytest.fixture(scope="module")
def measured() -> dict:
    return {mode: _measure(mode) for mode in MODES}


def test_gradients_are_bitwise_equal_in_every_mode():
    plain = _measure("none", dropout=0.1)["grads"]
    for mode in MODES[1:]:
        for a, b in zip(plain, _measure(mode, dropout=0.1)["grads"]):
            assert torch.equal(a, b), mode


def test_saved_activation_bytes_per_mode(measured):
    none, full, every_2, selective = (measured[m]["saved"] for m in MODES)
    assert full <= 0.2 * none  # full: at least 80% fewer bytes
    assert 2 * every_2 == none + full  # every_2: checkpoints 4 of the 8 identical blocks, exactly half-way
    assert none - selective >= 0.5 * (none - full)  # selective: at least half of full's saving ...
    extra_full = measured["full"]["flops"] - measured["none"]["flops"]
    extra_selective = measured["selective"]["flops"] - measured["none"]["flops"]
    assert 0 < extra_selective <= 0.3 * extra_full  # ... for at most 30% of full's extra compute


def test_recompute_flops_formula_is_what_the_counter_counts(measured):
    """The analytic recompute (dsrun.models.accounting) equals the counter's, attention counted over the
    full square as forward_flops does."""
    config = GPTConfig(**SHAPE)
    for mode in MODES[1:]:
        assert measured[mode]["flops"] - measured["none"]["flops"] == recompute_flops(config, BATCH, SEQ, mode)


def test_the_estimator_keeps_what_each_mode_keeps(measured):
    """What stays saved between forward and backward, per mode, against dsrun.estimate.activations, whose
    peak is backward in the last block: what blocks 0..6 keep, and block 7's activations in full."""
    shape = GPTShape(SHAPE["n_layer"], SHAPE["n_embd"], SHAPE["n_head"], SHAPE["vocab_size"])
    block_input = 4 * BATCH * SEQ * SHAPE["n_embd"]
    layers = SHAPE["n_layer"]
    per_block = (measured["none"]["saved"] - measured["full"]["saved"]) / layers + block_input
    assert abs(per_block - gpt_block_activation_bytes(shape, BATCH, SEQ, 4)) / per_block < 0.01
    kept = gpt_selective_kept_bytes(shape, BATCH, SEQ, 4)
    assert measured["selective"]["saved"] - measured["full"]["saved"] == layers * (kept - block_input)
    formula = {mode: gpt_activation_bytes(shape, BATCH, SEQ, "fp32", mode).blocks for mode in MODES}
    recomputing = gpt_block_activation_bytes(shape, BATCH, SEQ, 4)
    assert formula["none"] == layers * recomputing
    assert formula["full"] == (layers - 1) * block_input + recomputing
    assert formula["every_2"] == layers // 2 * (recomputing + block_input)  # block 7 is not checkpointed
    assert formula["selective"] == (layers - 1) * kept + recomputing


@pytest.mark.parametrize("value, canonical", [(True, "full"), (False, "none"), ("Every_1", "full"),
                                              ("every_3", "every_3"), ("SELECTIVE", "selective")])
def test_mode_spellings(value, canonical):
    assert GPTConfig(activation_checkpointing=value).activation_checkpointing == canonical


@pytest.mark.parametrize("value", ["every_0", "partial", "every2", 3])
def test_a_bad_mode_names_the_key(value):
    with pytest.raises(ConfigError, match="model.activation_checkpointing: got .*allowed: none, full, every_N"):
        GPT(**SHAPE, activation_checkpointing=value)


def test_every_n_checkpoints_blocks_0_n_2n():
    model = GPT(**SHAPE, activation_checkpointing="every_3")
    calls = []
    model.enable_activation_checkpointing(checkpoint_fn=lambda block, x: calls.append(block) or block(x))
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    blocks = list(model.transformer["h"])
    assert calls == [blocks[0], blocks[3], blocks[6]] and model.config.activation_checkpointing == "every_3"
