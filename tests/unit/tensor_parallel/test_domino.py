"""Domino (``deepspeed.runtime.domino``): the tensor-parallel Transformer whose half batches overlap each other's
all-reduces equals the unsplit Transformer, forward and backward, on 2 gloo ranks, with both schedules and
both residual placements; its collectives are the ones the overlap needs; what it cannot do is refused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import run_ranks

H, HEADS, HN, FFN, LAYERS, SEQ, BATCH = 16, 4, 4, 32, 2, 6, 4
DT = torch.float64  # the split sums in another order: float64 leaves ~1e-15 of it, so 1e-10 is a wide bound


def _config(**kw) -> SimpleNamespace:
    base = dict(hidden_size=H, num_attention_heads=HEADS, kv_channels=HN, ffn_hidden_size=FFN, num_layers=LAYERS,
                layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=True,
                apply_residual_connection_post_layernorm=False, params_dtype=DT, perform_initialization=True,
                init_method=torch.nn.init.normal_, output_layer_init_method=torch.nn.init.normal_,
                gated_linear_unit=False, domino_intra_layer_overlap=False)
    base.update(kw)
    return SimpleNamespace(**base)


class _Mpu:
    def __init__(self, world: int, group=None):
        self.world, self.group = world, group

    def get_tensor_model_parallel_world_size(self):
        return self.world

    def get_tensor_model_parallel_group(self):
        return self.group


def _full_weights(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g, dtype=DT) * scale

    return [dict(ln1_w=1 + rand(H), ln1_b=rand(H), qkv_w=rand(3 * HEADS * HN, H), qkv_b=rand(3 * HEADS * HN),
                 dense_w=rand(H, HEADS * HN), dense_b=rand(H), ln2_w=1 + rand(H), ln2_b=rand(H),
                 fc1_w=rand(FFN, H), fc1_b=rand(FFN), fc2_w=rand(H, FFN), fc2_b=rand(H)) for _ in range(LAYERS)]


def _reference(x: torch.Tensor, weights, final_w, final_b, post_ln: bool) -> torch.Tensor:
    """The unsplit Megatron layer in [s, b, h], per head (q, k, v) rows together, causal attention."""
    for w in weights:
        ln = F.layer_norm(x, (H,), w["ln1_w"], w["ln1_b"], 1e-5)
        heads = (ln @ w["qkv_w"].t() + w["qkv_b"]).view(SEQ, x.shape[1], HEADS, 3 * HN).permute(1, 2, 0, 3)
        q, k, v = heads.split(HN, dim=3)
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(SEQ, -1, HEADS * HN)
        attn = ctx @ w["dense_w"].t() + w["dense_b"]
        mid = attn + (ln if post_ln else x)
        ln2 = F.layer_norm(mid, (H,), w["ln2_w"], w["ln2_b"], 1e-5)
        x = F.gelu(ln2 @ w["fc1_w"].t() + w["fc1_b"]) @ w["fc2_w"].t() + w["fc2_b"] + (ln2 if post_ln else mid)
    return F.layer_norm(x, (H,), final_w, final_b, 1e-5)


def _load_shard(model, weights, final_w, final_b, rank: int, world: int) -> None:
    qkv_rows, cols, ffn = 3 * HEADS * HN // world, HEADS * HN // world, FFN // world
    with torch.no_grad():
        for layer, w in zip(model.layers, weights):
            attn = layer.self_attention
            layer.input_layernorm.weight.copy_(w["ln1_w"]), layer.input_layernorm.bias.copy_(w["ln1_b"])
            attn.query_key_value.weight.copy_(w["qkv_w"][rank * qkv_rows:(rank + 1) * qkv_rows])
            attn.query_key_value.bias.copy_(w["qkv_b"][rank * qkv_rows:(rank + 1) * qkv_rows])
            attn.dense.weight.copy_(w["dense_w"][:, rank * cols:(rank + 1) * cols]), attn.dense.bias.copy_(w["dense_b"])
            layer.post_attention_layernorm.weight.copy_(w["ln2_w"]), layer.post_attention_layernorm.bias.copy_(w["ln2_b"])
            layer.linear_fc1.weight.copy_(w["fc1_w"][rank * ffn:(rank + 1) * ffn])
            layer.linear_fc1.bias.copy_(w["fc1_b"][rank * ffn:(rank + 1) * ffn])
            layer.linear_fc2.weight.copy_(w["fc2_w"][:, rank * ffn:(rank + 1) * ffn]), layer.linear_fc2.bias.copy_(w["fc2_b"])
        model.final_layernorm.weight.copy_(final_w), model.final_layernorm.bias.copy_(final_b)


def _domino_on_ranks(rank: int, world: int):
    from dsrun import comm
    from dsrun.alias import install

    install()
    from deepspeed.runtime.domino.transformer import DominoTransformer, ModelType

    comm.init_distributed(dist_backend="gloo")
    weights = _full_weights()
    g = torch.Generator().manual_seed(1)
    final_w, final_b = 1 + 0.3 * torch.randn(H, generator=g, dtype=DT), 0.3 * torch.randn(H, generator=g, dtype=DT)
    x_full = torch.randn(SEQ, BATCH, H, generator=g, dtype=DT)
    probe = torch.randn(SEQ, BATCH, H, generator=g, dtype=DT)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)  # Megatron's mask
    out = {}
    for intra in (False, True):
        for post_ln in (False, True):
            # the reference, with autograd through the full weights
            ref_w = [{k: v.clone().requires_grad_() for k, v in w.items()} for w in weights]
            x_ref = x_full.clone().requires_grad_()
            ref = _reference(x_ref, ref_w, final_w, final_b, post_ln)
            (ref * probe).sum().backward()

            model = DominoTransformer(_config(domino_intra_layer_overlap=intra,
                                              apply_residual_connection_post_layernorm=post_ln),
                                      _Mpu(world), None, ModelType.encoder_or_decoder)
            _load_shard(model, weights, final_w, final_b, rank, world)
            x = x_full.clone().requires_grad_()
            comm.reset_comms_stats()
            y = model(x, causal)
            forward_reduces = comm.get_comms_stats()["all_reduce"]["count"]
            (y * probe).sum().backward()
            backward_reduces = comm.get_comms_stats()["all_reduce"]["count"] - forward_reduces
            qkv_rows, ffn = 3 * HEADS * HN // world, FFN // world
            grads = [(layer.self_attention.query_key_value.weight.grad,
                      ref_w[i]["qkv_w"].grad[rank * qkv_rows:(rank + 1) * qkv_rows]) for i, layer in enumerate(model.layers)]
            grads += [(layer.linear_fc2.weight.grad, ref_w[i]["fc2_w"].grad[:, rank * ffn:(rank + 1) * ffn])
                      for i, layer in enumerate(model.layers)]
            grads += [(layer.input_layernorm.weight.grad, ref_w[i]["ln1_w"].grad) for i, layer in enumerate(model.layers)]
            grads += [(layer.linear_fc2.bias.grad, ref_w[i]["fc2_b"].grad) for i, layer in enumerate(model.layers)]
            out[(intra, post_ln)] = dict(
                out=float((y - ref).abs().max()), scale=float(ref.abs().max()),
                dx=float((x.grad - x_ref.grad).abs().max()), dx_scale=float(x_ref.grad.abs().max()),
                dw=max(float((a - b).abs().max() / b.abs().max()) for a, b in grads),
                forward_reduces=forward_reduces, backward_reduces=backward_reduces)
    return out


def test_domino_equals_the_unsplit_transformer_on_two_ranks():
    results = run_ranks(_domino_on_ranks, 2, timeout=180)
    for rank_result in results:
        for case, r in rank_result.items():
            assert r["out"] <= 1e-10 * r["scale"] and r["dx"] <= 1e-10 * r["dx_scale"], case
            assert r["dw"] <= 1e-10, case  # each rank's shard gradient is its slice of the unsplit one
            # forward: the attention and the MLP outputs of each half; backward: the input gradient of each
            # column-parallel layer (QKV, fc1) of each half
            assert r["forward_reduces"] == 4 * LAYERS and r["backward_reduces"] == 4 * LAYERS, case


def test_domino_refuses_what_it_cannot_do(world_of_one):
    from dsrun.tensor_parallel.domino.transformer import AttnMaskType, DominoTransformer

    mpu = _Mpu(1)
    with pytest.raises(ValueError, match="gated_linear_unit"):
        DominoTransformer(_config(gated_linear_unit=True), mpu, None, None)
    with pytest.raises(ValueError, match="drop_path_rate"):
        DominoTransformer(_config(), mpu, None, None, drop_path_rate=0.1)
    with pytest.raises(ValueError, match="causal only"):
        DominoTransformer(_config(), mpu, None, None, self_attn_mask_type=AttnMaskType.padding)
    model = DominoTransformer(_config(num_layers=1), mpu, None, None)
    x = torch.randn(SEQ, 2, H, dtype=DT)
    with pytest.raises(ValueError, match="even batch"):
        model(torch.randn(SEQ, 1, H, dtype=DT), None)
    with pytest.raises(ValueError, match="not the causal mask"):
        model(x, torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bool))
    assert model(x, None).shape == x.shape
