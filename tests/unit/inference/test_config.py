"""``init_inference``'s config: the four call forms of the API page, DeepSpeed's aliases, conflicts, and every
setting dsrun cannot honour refused with one line naming it."""
from __future__ import annotations

import json

import pytest
import torch

import dsrun
from dsrun.inference.config import DeepSpeedInferenceConfig, merge_config
from dsrun.models.gpt import GPT
from dsrun.utils.errors import ConfigError


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 32, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, **overrides})


def test_case_1_no_config_no_kwargs_uses_deepspeeds_defaults():
    engine = dsrun.init_inference(tiny_gpt())
    assert engine._config.dtype == torch.float16  # DeepSpeed's default: the model is converted to half
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    assert engine.mp_world_size == 1 and engine.fused is None
    assert engine(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.float16


def test_case_2_config_only_as_dict_or_json_file(tmp_path):
    config = {"kernel_inject": True, "tensor_parallel": {"tp_size": 1}, "dtype": "fp32", "enable_cuda_graph": False}
    engine = dsrun.init_inference(tiny_gpt(), config=config)  # the example config of the API page
    assert engine.fused is not None and engine._config.dtype == torch.float32
    path = tmp_path / "inference.json"
    path.write_text(json.dumps(config))
    assert dsrun.init_inference(tiny_gpt(), config=str(path)).fused is not None


def test_case_3_kwargs_only():
    engine = dsrun.init_inference(tiny_gpt(), tensor_parallel={"tp_size": 1}, dtype=torch.bfloat16,
                                  replace_with_kernel_inject=True)
    assert engine.fused is not None and next(engine.module.parameters()).dtype == torch.bfloat16


def test_case_4_config_and_kwargs_merge_and_a_conflict_is_an_error():
    engine = dsrun.init_inference(tiny_gpt(), config={"dtype": torch.float32}, replace_with_kernel_inject=True)
    assert engine.fused is not None and engine._config.dtype == torch.float32
    dsrun.init_inference(tiny_gpt(), config={"dtype": "fp32"}, dtype="fp32")  # equal values are fine
    with pytest.raises(ValueError, match="Conflicting argument 'dtype'"):
        dsrun.init_inference(tiny_gpt(), config={"dtype": torch.float32}, dtype=torch.float16)
    with pytest.raises(ValueError, match="Conflicting argument 'replace_with_kernel_inject'"):
        merge_config({"kernel_inject": True}, replace_with_kernel_inject=False)  # an alias is its field


def test_a_config_that_is_neither_dict_nor_path_is_a_value_error():
    with pytest.raises(ValueError, match="Expected a string path"):
        merge_config(42)


@pytest.mark.parametrize("alias, field, value", [
    ("kernel_inject", "replace_with_kernel_inject", True), ("tp", "tensor_parallel", {"tp_size": 1}),
    ("tm", "triangular_masking", False), ("max_tokens", "max_out_tokens", 64), ("min_tokens", "min_out_tokens", 2),
    ("injection_dict", "injection_policy", {"Block": ("attn.c_proj",)}), ("args", "config", None),
    ("ckpt_config", "checkpoint_config", {"checkpoint_dir": "x"}), ("expert_group", "ep_group", None),
    ("expert_mp_group", "ep_mp_group", None),
])
def test_deepspeeds_aliases_set_their_fields(alias, field, value):
    by_alias, by_name = merge_config(**{alias: value}), merge_config(**{field: value})
    assert field in by_alias.model_fields_set
    assert getattr(by_alias, field) == getattr(by_name, field)
    if not isinstance(value, dict) and value is not None:
        assert getattr(by_alias, field) == value


def test_dtype_names():
    for name, dtype in (("fp16", torch.float16), ("torch.half", torch.float16), ("bf16", torch.bfloat16),
                        ("float", torch.float32), ("int8", torch.int8), (torch.float32, torch.float32)):
        assert merge_config(dtype=name).dtype == dtype
    with pytest.raises(ConfigError, match="init_inference.dtype"):
        merge_config(dtype="fp8")


def test_legacy_mp_size_sets_the_tensor_parallel_size():
    assert merge_config(mp_size=2).tp_size == 2
    assert merge_config(tensor_parallel={"tp_size": 2, "enabled": False}).tp_size == 1
    with pytest.raises(ConfigError, match="mp_size"):
        merge_config(mp_size=2, tensor_parallel={"tp_size": 4})


def test_an_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'max_out_tokens'"):
        merge_config(max_out_token=10)


NO_MOE = "moe: GPT has no dsrun.moe.layer.MoE layers"  # an MoE setting on a model without MoE layers
REFUSED = [
    ({"enable_cuda_graph": True}, "enable_cuda_graph: CUDA graphs need a CUDA device"),
    ({"use_triton": True}, "use_triton"), ({"triton_autotune": True}, "triton_autotune"),
    ({"transposed_mode": True}, "transposed_mode"), ({"zero": {"stage": 3}}, "zero: ZeRO-Inference"),
    ({"moe": True}, NO_MOE), ({"moe": {"ep_size": 2}}, NO_MOE),
    ({"moe_experts": [8]}, NO_MOE), ({"ep_size": 2}, NO_MOE),
    ({"moe_type": "residual"}, NO_MOE),
    ({"training_mp_size": 2}, "training_mp_size"), ({"replace_method": "layer"}, "replace_method"),
    ({"args": {"n_layer": 2}}, "init_inference.config"), ({"return_tuple": False}, "return_tuple"),
    ({"triangular_masking": False}, "triangular_masking: acts only with replace_with_kernel_inject"),
    ({"save_mp_checkpoint_path": "/tmp/x"}, "save_mp_checkpoint_path"),
    ({"checkpoint_config": {"save_mp_checkpoint_path": "/tmp/x"}}, "save_mp_checkpoint_path"),
    ({"min_out_tokens": 9, "max_out_tokens": 8}, "min_out_tokens"),
    ({"quant": {"weight": {"q_groups": 2}}, "dtype": "fp32"}, "quant: acts only with dtype=torch.int8"),
    ({"quant": {"weight": {"num_bits": 4}}, "dtype": "int8"}, "quant.weight.num_bits"),
    ({"quant": {"weight": {"q_type": "asymmetric"}}, "dtype": "int8"}, "quant.weight.q_type"),
    ({"quant": {"weight": {"post_init_quant": {"x": 1}}}, "dtype": "int8"}, "quant.weight.post_init_quant"),
    ({"quant": {"activation": {"enabled": True}}, "dtype": "int8"}, "quant.activation"),
]


@pytest.mark.parametrize("settings, message", REFUSED, ids=[m.split(":")[0] for _, m in REFUSED])
def test_settings_dsrun_cannot_honour_are_refused_naming_the_key(settings, message):
    with pytest.raises(ConfigError) as caught:
        dsrun.init_inference(tiny_gpt(), **settings)
    assert message in str(caught.value)
    assert all("\n" not in str(p) for p in caught.value.problems)


def test_kernel_injection_leaves_a_model_without_a_policys_layer_as_it_is():
    # (families with a policy: tests/unit/inference/test_kernel_injection.py)
    # no layer a kernel policy names: DeepSpeed's injection replaces nothing, and the model's forward runs
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    engine = dsrun.init_inference(model, kernel_inject=True, dtype=torch.float32)
    assert engine._config.replace_with_kernel_inject and engine.fused is None
    x = torch.randn(2, 4)
    assert torch.equal(engine(x), model(x))


def test_an_engine_is_not_wrapped_twice():
    engine = dsrun.init_inference(tiny_gpt(), dtype="fp32")
    with pytest.raises(Exception, match="already an InferenceEngine"):
        dsrun.init_inference(engine)


def test_the_engine_stands_in_for_its_model():
    model = tiny_gpt()
    engine = dsrun.init_inference(model, dtype="fp32")
    assert engine.config is model.config and engine.module is model
    assert engine.transformer is model.transformer  # other attributes read through to the model
    assert not any(p.requires_grad for p in engine.parameters()) and not model.training
    assert isinstance(DeepSpeedInferenceConfig(), DeepSpeedInferenceConfig)
