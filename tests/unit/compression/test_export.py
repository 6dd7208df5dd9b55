"""Compressed export: smaller on disk, reloaded outputs equal to the simulated model's, W8A8 after training."""
import pytest
import torch

from dsrun.compression import compression_scheduler, init_compression, redundancy_clean
from dsrun.compression.export import compressed_bytes, load_compressed, post_training_quantize, save_compressed
from dsrun.models.gpt import GPT

from .conftest import merge, technique

NANO = dict(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_embd=96)  # conf/model/gpt-nano.yaml


def _nano() -> GPT:
    torch.manual_seed(0)
    return GPT(**NANO)


@pytest.mark.parametrize("bits,groups,limit", [(8, 1, 0.27), (4, 32, 0.15)])
def test_quantized_gpt_is_smaller_on_disk_and_reloads_to_the_simulated_outputs(tmp_path, bits, groups, limit):
    model = _nano()
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())
    config = technique("weight_quantization", {"quantize_weight_in_forward": True, "schedule_offset": 0,
                                               "quantize_groups": groups}, {"start_bits": bits, "target_bits": bits})
    init_compression(model, config)
    compression_scheduler(model).step(step_zero_check=True)
    model.eval()
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    simulated = model(tokens)
    redundancy_clean(model, config)
    save_compressed(model, tmp_path, builder={"_target_": "dsrun.models.gpt.GPT", **NANO})
    assert compressed_bytes(tmp_path) <= limit * fp32_bytes
    reloaded = load_compressed(tmp_path)
    assert (reloaded(tokens) - simulated).abs().max() <= 1e-5
    assert reloaded.lm_head.weight is reloaded.transformer["wte"].weight


def test_pruned_gpt_reloads_with_its_smaller_shapes(tmp_path):
    model = _nano()
    config = merge(technique("head_pruning", {"schedule_offset": 0, "num_heads": 4}, {"dense_ratio": 0.5},
                             ["attn.c_proj"], related=[["attn.c_attn"]]),
                   technique("row_pruning", {"schedule_offset": 0}, {"dense_ratio": 0.25}, ["mlp.c_fc"],
                             related=[["mlp.c_proj"]]))
    init_compression(model, config)
    compression_scheduler(model).step(step_zero_check=True)
    redundancy_clean(model, config)
    save_compressed(model, tmp_path, builder={"_target_": "dsrun.models.gpt.GPT", **NANO})
    reloaded = load_compressed(tmp_path)
    tokens = torch.randint(0, 256, (1, 32))
    model.eval()
    assert torch.equal(reloaded(tokens), model(tokens))
    assert reloaded.transformer.h[1].mlp.c_fc.weight.shape == (96, 96)
    assert reloaded.transformer.h[1].attn.n_head == 2


def test_post_training_w8a8_keeps_activation_quantization_after_reload(tmp_path):
    model = _nano().eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    exact = model(tokens)
    post_training_quantize(model, groups=4)
    quantized = model(tokens)
    save_compressed(model, tmp_path, builder={"_target_": "dsrun.models.gpt.GPT", **NANO})
    reloaded = load_compressed(tmp_path)
    assert torch.equal(reloaded(tokens), quantized)
    assert reloaded.transformer.h[0].mlp.c_fc.ds_compression.activation.active
    assert 0 < (quantized - exact).abs().max() < 0.1 * exact.abs().max()


def test_load_into_a_given_model_and_clear_errors(tmp_path):
    from dsrun.utils.errors import UserError

    model = _nano()
    save_compressed(model, tmp_path)  # no builder: a model must be given
    with pytest.raises(UserError, match="does not record how to build"):
        load_compressed(tmp_path)
    again = load_compressed(tmp_path, model=GPT(**NANO))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    with pytest.raises(UserError, match="has no manifest.json"):
        load_compressed(tmp_path / "nothing")
