"""DeepSpeedTransformerLayer equals a plain PyTorch BERT layer, and each memory flag keeps exactly the bytes it
promises to drop without changing the gradients.

The reference is BERT's layer written out with nn.Linear/nn.LayerNorm, in float64. The layer runs in float64
(equal up to fp64 rounding) and in float32; a float32 result is compared with the float64 one within
``fp32_bound``: each value is the end of a chain of sums none longer than hidden + intermediate + seq terms,
so its error is a small multiple of that many fp32 roundings of the largest magnitude involved.
Saved activations are counted with saved-tensor hooks, one count per storage, parameters excluded: exact.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
from dsrun.ops.transformer import layer as layer_module
from dsrun.profiling.tensor_memory import SavedTensorBytes

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BATCH, SEQ, HIDDEN, HEADS, INTER = 2, 16, 32, 4, 128
U32 = torch.finfo(torch.float32).eps / 2


class ReferenceBertLayer(nn.Module):
    """BERT's transformer layer in plain PyTorch; Pre-LN moves each LayerNorm in front of its block."""

    def __init__(self, pre_layer_norm: bool, eps: float = 1e-12):
        super().__init__()
        self.pre_layer_norm = pre_layer_norm
        self.query, self.key, self.value = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.attention_output = nn.Linear(HIDDEN, HIDDEN)
        self.attention_norm = nn.LayerNorm(HIDDEN, eps=eps)
        self.intermediate = nn.Linear(HIDDEN, INTER)
        self.output = nn.Linear(INTER, HIDDEN)
        self.output_norm = nn.LayerNorm(HIDDEN, eps=eps)
        with torch.no_grad():  # non-trivial values everywhere: weights ~0.3, biases ~0.1, LayerNorm gains ~1
            for p in self.parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 0.1))
            for norm in (self.attention_norm, self.output_norm):
                norm.weight.add_(1.0)

    def attention(self, x, mask):
        batch, seq, _ = x.shape
        q, k, v = (p(x).view(batch, seq, HEADS, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / (HIDDEN // HEADS) ** 0.5
        probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        return self.attention_output((probs @ v).transpose(1, 2).reshape(batch, seq, HIDDEN))

    def feed_forward(self, x):
        return self.output(F.gelu(self.intermediate(x)))

    def forward(self, x, mask=None):
        if self.pre_layer_norm:
            a = x + self.attention(self.output_norm(x), mask)
            return a + self.feed_forward(self.attention_norm(a))
        a = self.attention_norm(x + self.attention(x, mask))
        return self.output_norm(a + self.feed_forward(a))

    def initial(self):
        """DeepSpeed's initial_weights / initial_biases order."""
        mods = (self.query, self.key, self.value, self.attention_output, self.attention_norm, self.intermediate,
                self.output, self.output_norm)
        return [m.weight for m in mods], [m.bias for m in mods]


def config(**kw) -> DeepSpeedTransformerConfig:
    settings = dict(batch_size=BATCH, max_seq_length=SEQ, hidden_size=HIDDEN, heads=HEADS,
                    attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0, num_hidden_layers=2,
                    initializer_range=0.02, intermediate_size=INTER)
    settings.update(kw)
    return DeepSpeedTransformerConfig(**settings)


def bert_mask(device="cpu", dtype=torch.float64):
    mask = torch.zeros(BATCH, 1, 1, SEQ, dtype=dtype, device=device)
    mask[1, ..., -5:] = -10000.0
    return mask


def fp32_bound(reference: torch.Tensor) -> float:
    return 8 * (HIDDEN + INTER + SEQ) * U32 * max(1.0, float(reference.detach().abs().max()))


def run(module, x, mask):
    out = module(x, mask)
    grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad(out, [x] + params, grad)
    return out, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre_layer_norm", [True, False])
def test_layer_equals_a_plain_pytorch_bert_layer_forward_and_backward(pre_layer_norm, device):
    torch.manual_seed(0)
    reference = ReferenceBertLayer(pre_layer_norm).double().to(device)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, device=device, requires_grad=True)
    ref_out, ref_grads = run(reference, x, bert_mask(device))
    ref_by_name = dict(zip(["x"] + [n for n, _ in reference.named_parameters()], ref_grads))
    weights, biases = reference.initial()
    for dtype in (torch.float64, torch.float32):
        layer = DeepSpeedTransformerLayer(config(pre_layer_norm=pre_layer_norm),
                                          [w.detach().to(dtype) for w in weights],
                                          [b.detach().to(dtype) for b in biases]).to(device)
        xd = x.detach().to(dtype).requires_grad_()
        out, grads = run(layer, xd, bert_mask(device, dtype))
        by_name = dict(zip(["x"] + [n for n, _ in layer.named_parameters()], grads))
        qkv_w, qkv_b = by_name["attn_qkvw"].split(HIDDEN), by_name["attn_qkvb"].split(HIDDEN)
        pairs = [(out.detach(), ref_out.detach()), (by_name["x"], ref_by_name["x"])]
        for i, proj in enumerate(("query", "key", "value")):
            pairs += [(qkv_w[i], ref_by_name[f"{proj}.weight"]), (qkv_b[i], ref_by_name[f"{proj}.bias"])]
        for ours, theirs in (("attn_ow", "attention_output.weight"), ("attn_ob", "attention_output.bias"),
                             ("attn_nw", "attention_norm.weight"), ("attn_nb", "attention_norm.bias"),
                             ("inter_w", "intermediate.weight"), ("inter_b", "intermediate.bias"),
                             ("output_w", "output.weight"), ("output_b", "output.bias"),
                             ("norm_w", "output_norm.weight"), ("norm_b", "output_norm.bias")):
            pairs.append((by_name[ours], ref_by_name[theirs]))
        for i, (got, want) in enumerate(pairs):
            error = float((got.double() - want).abs().max())
            if dtype == torch.float64:
                assert error <= 1e-9 * max(1.0, float(want.abs().max())), error
            else:
                assert error <= fp32_bound(want), (error, fp32_bound(want))
                if i < 2:  # output and input gradient: the 1e-5 relative to their size
                    assert error <= 1e-5 * max(1.0, float(want.abs().max())), error


def saved_bytes(layer: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd keeps for backward (parameters excluded), and the output."""
    with SavedTensorBytes(exclude=layer.parameters()) as saved:
        out = layer(x)
    return saved.bytes, out


F32 = 4
ACTIVATION = BATCH * SEQ * HIDDEN * F32
ROW_STATS = BATCH * SEQ * F32  # one LayerNorm mean per token
SAVINGS = {
    # the dropped-out attention probabilities [B, heads, S, S]
    "attn_dropout_checkpoint": {True: BATCH * HEADS * SEQ * SEQ * F32, False: BATCH * HEADS * SEQ * SEQ * F32},
    # the GELU output [B, S, I]
    "gelu_checkpoint": {True: BATCH * SEQ * INTER * F32, False: BATCH * SEQ * INTER * F32},
    # Pre-LN: both LayerNorm inputs (the layer input and the attention residual) and two means;
    # Post-LN: the two LayerNorm inputs, but the layer output is kept instead of the last one's input
    "normalize_invertible": {True: 2 * ACTIVATION + 2 * ROW_STATS, False: ACTIVATION + 2 * ROW_STATS},
}


@pytest.mark.parametrize("pre_layer_norm", [True, False])
@pytest.mark.parametrize("flag", list(SAVINGS))
def test_each_memory_flag_drops_its_activations_and_keeps_the_gradients(flag, pre_layer_norm):
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    results = {}
    for enabled in (False, True):
        torch.manual_seed(1)
        layer = DeepSpeedTransformerLayer(config(pre_layer_norm=pre_layer_norm, attn_dropout_ratio=0.1,
                                                 hidden_dropout_ratio=0.1, **{flag: enabled}))
        torch.manual_seed(2)  # the same dropout masks in both runs
        nbytes, out = saved_bytes(layer, x)
        grad = torch.linspace(-1, 1, out.numel()).view_as(out)
        results[enabled] = nbytes, out, torch.autograd.grad(out, [x] + list(layer.parameters()), grad)
    assert results[False][0] - results[True][0] == SAVINGS[flag][pre_layer_norm]
    assert torch.equal(results[False][1], results[True][1])  # the forward pass is the same computation
    for off, on in zip(results[False][2], results[True][2]):
        # recomputing dropout or GELU repeats the same operations; the invertible LayerNorm recovers its input
        # from its output, (y - β) / γ, which costs a few fp32 roundings
        assert (off - on).abs().max() <= fp32_bound(off)


def test_all_flags_together_save_the_sum():
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    counts = []
    for flags in ({}, {name: True for name in SAVINGS}):
        layer = DeepSpeedTransformerLayer(config(attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, **flags))
        counts.append(saved_bytes(layer, x)[0])
    assert counts[0] - counts[1] == sum(s[True] for s in SAVINGS.values())


def test_without_attention_dropout_the_fused_kernel_keeps_no_probabilities():
    """attn_dropout_ratio 0 (or eval): scaled_dot_product_attention saves no [B, heads, S, S] tensor at all."""
    layer = DeepSpeedTransformerLayer(config())
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        layer(torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True))
    assert (BATCH, HEADS, SEQ, SEQ) not in shapes


# --- configuration ------------------------------------------------------------------------------------------
def test_config_defaults_follow_deepspeed():
    c = DeepSpeedTransformerConfig(hidden_size=64, heads=4)
    assert c.intermediate_size == 256 and c.layer_norm_eps == 1e-12 and c.pre_layer_norm and not c.fp16
    assert c.batch_size == -1 and c.seed == -1 and c.adjust_init_range and c.training and not c.return_tuple
    with pytest.raises(ValueError, match="must be set"):
        DeepSpeedTransformerLayer(DeepSpeedTransformerConfig())
    with pytest.raises(ValueError, match="not a multiple of heads"):
        DeepSpeedTransformerLayer(DeepSpeedTransformerConfig(hidden_size=30, heads=4))


def test_config_from_dict_and_json_file(tmp_path):
    values = {"hidden_size": 64, "heads": 8, "pre_layer_norm": False, "gelu_checkpoint": True}
    c = DeepSpeedTransformerConfig.from_dict(values)
    assert (c.hidden_size, c.heads, c.intermediate_size, c.pre_layer_norm, c.gelu_checkpoint) == (64, 8, 256, False,
                                                                                                   True)
    path = tmp_path / "layer.json"
    path.write_text(json.dumps(values), encoding="utf-16")  # DeepSpeed writes these files in UTF-16
    assert DeepSpeedTransformerConfig.from_json_file(path).__dict__ == c.__dict__
    path.write_text(json.dumps(values), encoding="utf-8")
    assert DeepSpeedTransformerConfig.from_json_file(path).__dict__ == c.__dict__
    with pytest.raises(ValueError, match="hiden_size"):
        DeepSpeedTransformerConfig.from_dict({"hiden_size": 64})


def test_initialisation_and_layer_ids():
    first = DeepSpeedTransformerLayer.layer_id
    torch.manual_seed(0)
    layers = [DeepSpeedTransformerLayer(config(hidden_size=256, heads=4, intermediate_size=1024,
                                               num_hidden_layers=8, initializer_range=0.05, adjust_init_range=adjust))
              for adjust in (True, False)]
    assert [lay.config.layer_id for lay in layers] == [first, first + 1]
    assert DeepSpeedTransformerLayer.layer_id == first + 2
    adjusted, plain = layers
    # 65,536 samples: the sample std is within 2% of the true one (its relative error is ~1/sqrt(2n) = 0.3%)
    assert abs(float(adjusted.attn_qkvw.detach().std()) - 0.05) < 0.001
    assert abs(float(adjusted.attn_ow.detach().std()) - 0.05 / 4) < 0.05 / 4 * 0.02
    assert abs(float(adjusted.output_w.detach().std()) - 0.05 / 4) < 0.05 / 4 * 0.02
    assert abs(float(plain.output_w.detach().std()) - 0.05) < 0.001
    assert torch.equal(adjusted.attn_nw, torch.ones(256)) and torch.equal(adjusted.inter_b, torch.zeros(1024))


def test_initial_weights_are_used_as_the_parameters():
    reference = ReferenceBertLayer(pre_layer_norm=True)
    weights, biases = reference.initial()
    layer = DeepSpeedTransformerLayer(config(), weights, biases)
    assert layer.attn_ow is weights[3] and layer.norm_b is biases[7]
    assert torch.equal(layer.attn_qkvw, torch.cat([w.detach() for w in weights[:3]]))
    with pytest.raises(ValueError, match="lists of 8 tensors"):
        DeepSpeedTransformerLayer(config(), weights[:7], biases)


def test_seed_gives_dropout_masks_of_their_own():
    """With ``seed`` the masks come from that seed's generator, whatever torch's global RNG is doing."""
    x = torch.randn(BATCH, SEQ, HIDDEN)
    outputs = []
    for global_seed in (1, 2):
        layer_module._GENERATORS.clear()  # a fresh start of the seed's stream, as in a new process
        torch.manual_seed(0)
        layer = DeepSpeedTransformerLayer(config(seed=7, attn_dropout_ratio=0.2, hidden_dropout_ratio=0.2))
        torch.manual_seed(global_seed)
        outputs.append(layer(x))
    assert torch.equal(outputs[0], outputs[1])
    unseeded = []
    for global_seed in (1, 2):
        torch.manual_seed(0)
        layer = DeepSpeedTransformerLayer(config(attn_dropout_ratio=0.2, hidden_dropout_ratio=0.2))
        torch.manual_seed(global_seed)
        unseeded.append(layer(x))
    assert not torch.equal(unseeded[0], unseeded[1])


def test_fp16_computes_in_half_precision():
    torch.manual_seed(0)
    layer = DeepSpeedTransformerLayer(config())
    x = torch.randn(BATCH, SEQ, HIDDEN)
    with torch.no_grad():
        full = layer(x)
        layer.config.fp16 = True
        half = layer(x)
    assert half.dtype == torch.float16
    u16 = torch.finfo(torch.float16).eps / 2
    assert float((half.double() - full.double()).abs().max()) <= 8 * (HIDDEN + INTER + SEQ) * u16 * max(
        1.0, float(full.abs().max()))


def test_return_tuple_training_and_size_limits():
    layer = DeepSpeedTransformerLayer(config(return_tuple=True, training=False))
    assert not layer.training
    out = layer(torch.randn(BATCH, SEQ, HIDDEN))
    assert isinstance(out, tuple) and len(out) == 1 and out[0].shape == (BATCH, SEQ, HIDDEN)
    with pytest.raises(ValueError, match="exceeds the configured batch_size 2 / max_seq_length 16"):
        layer(torch.randn(BATCH + 1, SEQ, HIDDEN))
    with pytest.raises(ValueError, match="max_seq_length"):
        layer(torch.randn(BATCH, SEQ + 1, HIDDEN))
    with pytest.raises(NotImplementedError, match="head_mask"):
        layer(torch.randn(BATCH, SEQ, HIDDEN), head_mask=torch.ones(HEADS))


def test_grads_list_receives_each_parameter_gradient_once():
    layer = DeepSpeedTransformerLayer(config())
    grads: list = []
    x = torch.randn(BATCH, SEQ, HIDDEN)
    for _ in range(2):  # hooks do not pile up across calls
        grads.clear()
        layer(x, grads=grads).sum().backward()
        assert sorted(name for _, name in grads) == sorted(layer_module.GRAD_NAMES)
    by_name = {name: grad for grad, name in grads}
    assert torch.equal(by_name["V_W"], layer.attn_qkvw.grad[2 * HIDDEN:] / 2)  # two backward passes accumulated
    assert torch.equal(by_name["norm_B"], layer.norm_b.grad / 2)


def test_stochastic_mode_runs_attention_dropout_in_the_fused_kernel(monkeypatch):
    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw.get("dropout_p")) or fused(*a, **kw))
    x = torch.randn(BATCH, SEQ, HIDDEN)
    DeepSpeedTransformerLayer(config(attn_dropout_ratio=0.1))(x)
    assert calls == []  # the deterministic path materialises the probabilities for its own dropout
    DeepSpeedTransformerLayer(config(attn_dropout_ratio=0.1, stochastic_mode=True))(x)
    assert calls == [0.1]
