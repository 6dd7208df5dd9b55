"""AutoTP training's split, read in one process: what each rank holds, that the ranks' slices put back together
are the model, the conversion's merge, and what the config and ``tp_model_init`` accept."""
from __future__ import annotations

import copy

import pytest
import torch

from dsrun.checkpoint.tensor_parallel import merge_module_states, merge_slices, slice_dim
from dsrun.compose import compose_runspec
from dsrun.config import load_ds_config
from dsrun.runspec import resolve_run
from dsrun.tensor_parallel import (AutoTPFeature, ColumnParallelLinear, RowParallelLinear, reset_tp_model_init,
                                   split_for_training, tp_model_init)
from dsrun.utils.errors import ConfigError
from tests.integration._inference_models import dsrun_gpt, hf_model


@pytest.fixture(autouse=True)
def _forget_tp_model_init():
    reset_tp_model_init()
    yield
    reset_tp_model_init()


def _split(model: torch.nn.Module, size: int = 2):
    shards, layouts = [], []
    for rank in range(size):
        shard = copy.deepcopy(model)
        layouts.append(split_for_training(shard, None, rank, size))  # no forward: no collective is needed
        shards.append(shard)
    return shards, layouts


@pytest.mark.parametrize("name", ["gpt2", "llama", "dsrun-gpt"])
def test_the_ranks_slices_merge_back_into_the_model_and_keep_its_parameters(name):
    if name != "dsrun-gpt":
        pytest.importorskip("transformers")
    model = dsrun_gpt() if name == "dsrun-gpt" else hf_model(name)
    shard = copy.deepcopy(model)
    params = list(shard.parameters())
    split_for_training(shard, None, 0, 2)
    assert [id(p) for p in shard.parameters()] == [id(p) for p in params]  # an optimizer built before still holds them
    shards, layouts = _split(model)
    assert layouts[0].splits == layouts[1].splits
    merged = merge_module_states([s.state_dict() for s in shards], layouts[0].splits)
    whole = model.state_dict()
    assert merged.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(merged[key], value), key


def test_gpt2_conv1d_is_cut_along_its_output_columns_head_by_head_and_its_heads_halve():
    pytest.importorskip("transformers")
    model = hf_model("gpt2")  # 4 heads of 8, n_embd 32: c_attn [32, 96] = q|k|v
    shards, layouts = _split(model)
    attn = [s.transformer.h[0].attn for s in shards]
    assert [(a.num_heads, a.split_size) for a in attn] == [(2, 16), (2, 16)]
    assert isinstance(attn[0].c_attn, ColumnParallelLinear) and isinstance(attn[0].c_proj, RowParallelLinear)
    assert attn[0].c_attn.weight.shape == (32, 48) and attn[0].c_proj.weight.shape == (16, 32)
    assert layouts[0].splits["transformer.h.0.attn.c_attn.weight"] == (1, 3)
    assert layouts[0].splits["transformer.h.0.attn.c_proj.weight"] == (0, 1)
    assert "transformer.h.0.attn.c_proj.bias" not in layouts[0].splits  # added once, after the all-reduce
    q_of_rank1 = model.transformer.h[0].attn.c_attn.weight[:, 16:32]  # q's heads 2-3
    assert torch.equal(attn[1].c_attn.weight[:, :16], q_of_rank1)
    assert attn[0].c_attn.weight.tensor_model_parallel and attn[0].c_attn.weight.partition_stride == 3


def test_slicing_and_merging_fused_parts_round_trip():
    whole = torch.arange(6 * 8.0).view(6, 8)
    for dim, parts in ((0, 3), (1, 2), (1, 1)):
        pieces = [slice_dim(whole, dim, parts, r, 2) for r in range(2)]
        assert torch.equal(merge_slices(pieces, dim, parts), whole)
    assert torch.equal(slice_dim(whole, 0, 3, 1, 2), whole[[1, 3, 5]])


def _config(**extra):
    return load_ds_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2}, **extra}, world_size=1)


def test_the_config_and_tp_model_init_agree_or_are_refused():
    assert AutoTPFeature.build(_config()).group_sizes() == {"model": 2}
    assert AutoTPFeature.build(load_ds_config({"train_batch_size": 2}, world_size=1)) is None
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        AutoTPFeature.build(_config(zero_optimization={"stage": 3}))
    model = torch.nn.Linear(2, 2)
    assert tp_model_init(model, tp_size=2, dtype=torch.bfloat16) is model  # records; splits at initialize
    with pytest.raises(ValueError, match="Conflicting tp_model_init"):
        tp_model_init(model, tp_size=4, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="disagrees with the config's precision"):
        AutoTPFeature.build(_config(fp16={"enabled": True}))
    assert AutoTPFeature.build(load_ds_config({"train_batch_size": 2, "bf16": {"enabled": True}})).size == 2
    with pytest.raises(ConfigError, match="tp_model_init\\(tp_size=2\\)"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 4}))


def test_the_gpt_tp_recipe_counts_data_parallel_ranks_only():
    run = resolve_run(compose_runspec(["+recipe=gpt_tp"]))
    assert run.ds.tensor_parallel.autotp_size == 2 and run.world_size == 2
    assert run.ds.train_batch_size == run.ds.train_micro_batch_size_per_gpu  # 2 ranks, one data-parallel rank
    run = resolve_run(compose_runspec(["+recipe=gpt_tp", "launcher.num_procs=4"]))
    assert run.ds.train_batch_size == 2 * run.ds.train_micro_batch_size_per_gpu
    with pytest.raises(ConfigError, match="ds.tensor_parallel.autotp_size: 2 does not divide the 3 ranks"):
        resolve_run(compose_runspec(["+recipe=gpt_tp", "launcher.num_procs=3"]))
