"""Automatic tensor parallelism read from the module tree: which linears pair up, how they are cut, and the
weight-only INT8 linears. The cut is checked exactly: the ranks' slices put back together are the weights."""
from __future__ import annotations

import copy

import pytest
import torch

from dsrun.inference.auto_tp import check_split, plan_model, quantize_blocks, shard_model
from dsrun.inference.groups import TPGroup
from dsrun.inference.layers import ColumnParallelLinear, InferenceLinear, RowParallelLinear
from dsrun.models.gpt import GPT
from dsrun.utils.errors import ConfigError
from tests.integration._inference_models import UserModel, hf_model


def gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 32, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 16, **overrides}).eval()


def test_dsrun_gpt_pairs_fused_qkv_with_the_output_projection():
    plans = plan_model(gpt())
    assert [p.describe() for p in plans] == [
        f"transformer.h.{i} (Block): attn.c_attn[x3] -> attn.c_proj; mlp.c_fc -> mlp.c_proj" for i in range(2)]


HF_PLANS = {
    "gpt2": "transformer.h.0 (GPT2Block): attn.c_attn[x3] -> attn.c_proj; mlp.c_fc -> mlp.c_proj",
    "llama": "model.layers.0 (LlamaDecoderLayer): self_attn.q_proj+self_attn.k_proj+self_attn.v_proj -> "
             "self_attn.o_proj; mlp.gate_proj+mlp.up_proj -> mlp.down_proj",
    "mistral": "model.layers.0 (MistralDecoderLayer): self_attn.q_proj+self_attn.k_proj+self_attn.v_proj -> "
               "self_attn.o_proj; mlp.gate_proj+mlp.up_proj -> mlp.down_proj",
    "opt": "model.decoder.layers.0 (OPTDecoderLayer): self_attn.k_proj+self_attn.v_proj+self_attn.q_proj -> "
           "self_attn.out_proj; fc1 -> fc2",
    "bert": "bert.encoder.layer.0 (BertLayer): attention.self.query+attention.self.key+attention.self.value -> "
            "attention.output.dense; intermediate.dense -> output.dense",
    "t5": "decoder.block.0 (T5Block): layer.0.SelfAttention.q+layer.0.SelfAttention.k+layer.0.SelfAttention.v -> "
          "layer.0.SelfAttention.o; layer.1.EncDecAttention.q+layer.1.EncDecAttention.k+layer.1.EncDecAttention.v -> "
          "layer.1.EncDecAttention.o; layer.2.DenseReluDense.wi -> layer.2.DenseReluDense.wo",
}


@pytest.mark.parametrize("name", sorted(HF_PLANS))
def test_hugging_face_blocks_are_read_without_per_model_code(name):
    pytest.importorskip("transformers")
    plans = plan_model(hf_model(name))
    assert HF_PLANS[name] in [p.describe() for p in plans]


def test_grouped_query_attention_splits_only_as_far_as_its_key_value_heads():
    pytest.importorskip("transformers")
    model = hf_model("llama")  # 4 query heads, 2 key/value heads
    check_split(model, 2)
    with pytest.raises(ConfigError) as caught:
        check_split(model, 4)
    lines = [str(p) for p in caught.value.problems]
    assert "model.layers.*.self_attn.k_proj: its 2 heads do not split over tp_size=4" in lines[0]


def test_a_block_auto_tp_cannot_read_asks_for_an_injection_policy():
    with pytest.raises(ConfigError, match=r"injection_policy=\{UserBlock"):
        plan_model(UserModel())
    plans = plan_model(UserModel(), {"UserBlock": ("mix", "shrink")})  # the class or its name
    assert plans[0].describe() == "layers.0 (UserBlock): to_qkv[x3] -> mix; expand -> shrink"
    with pytest.raises(ConfigError, match="must name its row-parallel linears"):
        plan_model(UserModel(), {"UserBlock": object})


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ConfigError, match="found no Transformer blocks"):
        plan_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))


def _shards(model: torch.nn.Module, size: int) -> list[torch.nn.Module]:
    shards = []
    for rank in range(size):
        shard = copy.deepcopy(model)
        shard_model(shard, TPGroup(None, rank, size))  # no forward: no collective is needed
        shards.append(shard)
    return shards


def test_the_slices_of_all_ranks_put_together_are_the_whole_weights():
    model = gpt()
    shards = _shards(model, 2)
    for layer in range(2):
        whole, parts = model.transformer["h"][layer], [s.transformer["h"][layer] for s in shards]
        assert [p.attn.n_head for p in parts] == [2, 2]
        assert all(isinstance(p.attn.c_attn, ColumnParallelLinear) and isinstance(p.attn.c_proj, RowParallelLinear)
                   for p in parts)
        # fused q|k|v: each rank holds its heads of q, of k and of v
        per_rank = [p.attn.c_attn.weight.view(3, 8, 16) for p in parts]
        torch.testing.assert_close(torch.cat(per_rank, dim=1).view(48, 16), whole.attn.c_attn.weight, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p.attn.c_proj.weight for p in parts], dim=1), whole.attn.c_proj.weight,
                                   rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p.mlp.c_fc.bias for p in parts]), whole.mlp.c_fc.bias, rtol=0, atol=0)
        for p in parts:  # a row-parallel bias is added once, after the all-reduce: every rank keeps it whole
            torch.testing.assert_close(p.mlp.c_proj.bias, whole.mlp.c_proj.bias, rtol=0, atol=0)
    for shard in shards:  # embeddings, norms and the (tied) head stay whole
        assert shard.lm_head.weight is shard.transformer["wte"].weight
        torch.testing.assert_close(shard.transformer["wte"].weight, model.transformer["wte"].weight, rtol=0, atol=0)


def test_t5_relative_position_bias_is_split_by_heads():
    pytest.importorskip("transformers")
    model = hf_model("t5")
    shards = _shards(model, 2)
    attention = [s.encoder.block[0].layer[0].SelfAttention for s in shards]
    assert [a.n_heads for a in attention] == [2, 2]
    torch.testing.assert_close(torch.cat([a.relative_attention_bias.weight for a in attention], dim=1),
                               model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight,
                               rtol=0, atol=0)


def test_gpt2_conv1d_and_its_split_size():
    pytest.importorskip("transformers")
    model = hf_model("gpt2")
    shards = _shards(model, 2)
    attn = [s.transformer.h[0].attn for s in shards]
    assert [(a.num_heads, a.split_size) for a in attn] == [(2, 16), (2, 16)]
    whole = model.transformer.h[0].attn.c_attn.weight.t()  # Conv1D keeps [in, out]
    torch.testing.assert_close(torch.cat([a.c_attn.weight.view(3, 16, 32) for a in attn], dim=1).view(96, 32),
                               whole, rtol=0, atol=0)


def test_int8_weight_error_is_within_half_a_quantization_step():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 96), torch.randn(5, 96)
    for q_groups in (1, 4, 64):
        layer = InferenceLinear(weight, None)
        layer.quantize_(q_groups)
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.unique().numel() == q_groups
        # each stored weight is within half a step of the original
        step = layer.weight_scale[:, None]
        assert ((layer.dequantized_weight() - weight).abs() <= step / 2 * (1 + 1e-6)).all()
        # so each output is within sum_j |x_j| * step_i / 2 of x W^T, plus the fp32 rounding of both sums
        unit = torch.finfo(torch.float32).eps / 2
        bound = (x.abs() @ (step.expand_as(weight) / 2).t()) + 2 * 96 * unit * (x.abs() @ weight.abs().t())
        assert ((layer(x) - x @ weight.t()).abs() <= bound).all()
    with pytest.raises(ValueError, match="q_groups=5 does not divide the 64 output rows"):
        InferenceLinear(weight, None).quantize_(5)


def test_int8_blocks_store_a_quarter_of_the_weight_bytes_and_qkv_can_stay_float():
    model = gpt()
    fp32_bytes = sum(m.weight.numel() * 4 for b in model.transformer["h"] for m in b.modules()
                     if isinstance(m, torch.nn.Linear))
    plans = shard_model(model, TPGroup(None, 0, 1))
    assert quantize_blocks(plans, q_groups=1, qkv=True) == 8
    int8_bytes = sum(m.weight.numel() * m.weight.element_size() for b in model.transformer["h"]
                     for m in b.modules() if isinstance(m, InferenceLinear))
    assert int8_bytes * 4 == fp32_bytes
    other = gpt()
    assert quantize_blocks(shard_model(other, TPGroup(None, 0, 1)), q_groups=1, qkv=False) == 6
    assert other.transformer["h"][0].attn.c_attn.weight.dtype == torch.float32
    assert other.transformer["h"][0].attn.c_proj.weight.dtype == torch.int8


def test_injection_policy_and_its_tuple_form_through_init_inference():
    import dsrun
    from tests.integration._inference_models import UserBlock

    for kwargs in ({"injection_policy": {UserBlock: ("mix", "shrink")}},
                   {"injection_dict": {"UserBlock": ("mix", "shrink")}},
                   {"injection_policy_tuple": (UserBlock, ("mix", "shrink"))}):
        engine = dsrun.init_inference(UserModel(), dtype="fp32", **kwargs)
        assert engine.block_plans[0].describe() == "layers.0 (UserBlock): to_qkv[x3] -> mix; expand -> shrink"
    with pytest.raises(ConfigError, match="no output projection follows"):
        dsrun.init_inference(UserModel(), dtype="int8")  # INT8 needs the block plan, which needs the policy
