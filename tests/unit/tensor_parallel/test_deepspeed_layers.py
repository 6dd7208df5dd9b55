"""DeepSpeed's AutoTP names on dsrun's AutoTP: ``deepspeed.module_inject.layers`` (``LinearLayer``,
``LinearAllreduce``, ``set_autotp_mode``), ``module_inject.tp_shard``'s shard sizes, the split parameters'
``gather_params`` / ``_tp_partition`` and ``deepspeed.checkpoint.constants``."""
from __future__ import annotations

import copy

import pytest
import torch

from dsrun import comm
from dsrun.alias.paths import target_of
from dsrun.config import load_ds_config
from dsrun.tensor_parallel import AutoTPFeature, reset_tp_model_init
from dsrun.tensor_parallel import shard_sizes
from dsrun.tensor_parallel.deepspeed_layers import (LinearAllreduce, LinearLayer, is_autotp_training_mode,
                                                    set_autotp_mode)
from dsrun.tensor_parallel.shard_sizes import get_shard_size, get_shard_size_list, set_num_kv_heads
from tests.helpers import run_ranks


def test_shard_sizes_tile_the_dimension_as_deepspeed_cuts_it():
    assert get_shard_size_list(129, 4) == [33, 32, 32, 32]  # the first ranks take the extra elements
    assert get_shard_size(128, 2, rank=1) == 64
    set_num_kv_heads(3)
    try:  # whole key/value heads per rank (the first rank one more), but an MLP projection is cut evenly
        assert get_shard_size_list(24, 2, "self_attn.k_proj") == [16, 8]
        assert get_shard_size_list(24, 2, "mlp.up_proj") == [12, 12]
    finally:
        set_num_kv_heads(None)
    shard_sizes.set_tp_grain_size(64)
    try:  # grains of 64, the tail that fills no grain to the last rank
        assert get_shard_size_list(200, 2) == [128, 72]
    finally:
        shard_sizes.set_tp_grain_size(1)


def test_deepspeeds_module_paths_reach_them():
    assert target_of("deepspeed.module_inject.layers") == "dsrun.compat.module_inject.layers"
    assert target_of("deepspeed.module_inject.tp_shard") == "dsrun.compat.module_inject.tp_shard"
    from dsrun.checkpoint import constants
    from dsrun.compat.module_inject import layers, tp_shard

    assert layers.LinearLayer is LinearLayer and tp_shard.get_shard_size_list is get_shard_size_list
    assert target_of("deepspeed.checkpoint.constants") == "dsrun.checkpoint.constants"
    assert (constants.UNIVERSAL_CHECKPOINT_INFO, constants.MODEL_FILE_PREFIX) == ("universal_checkpoint_info",
                                                                                    "mp_rank_")


def test_initialize_with_autotp_turns_on_training_mode():
    set_autotp_mode(training=False)
    reset_tp_model_init()
    try:
        AutoTPFeature.build(load_ds_config({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2}},
                                           world_size=1))
        assert is_autotp_training_mode()
    finally:
        set_autotp_mode(training=False)


def _layers_on_two_ranks(rank: int, world_size: int) -> None:
    comm.init_distributed(verbose=False)
    try:
        group = comm.new_group([0, 1])
        assert comm.get_world_size(comm.get_world_group()) == 2  # DeepSpeed's comm.get_world_group (its tests' mpu)
        torch.manual_seed(0)  # the same whole layers and input on both ranks
        whole, x = torch.nn.Linear(8, 7), torch.randn(3, 8, requires_grad=True)
        (x @ whole.weight.t() + whole.bias).pow(2).sum().backward()
        column = LinearLayer(copy.deepcopy(whole), group, gather_output=True)
        assert column.shard_sizes == [4, 3] and column.weight.shape == (column.shard_sizes[rank], 8)
        xc = x.detach().clone().requires_grad_()
        column(xc).pow(2).sum().backward()  # gathered output: the whole layer's, and its gradients
        start = [0, 4][rank]
        torch.testing.assert_close(column.weight.grad, whole.weight.grad[start:start + column.shard_sizes[rank]])
        torch.testing.assert_close(xc.grad, x.grad)  # the input's gradient summed over the group
        # gather_params puts the whole weight back on every rank, _tp_partition cuts this rank's rows again
        own = column.weight.detach().clone()
        column.weight.gather_params([column.weight, column.bias])
        torch.testing.assert_close(column.weight.data, whole.weight.data)
        torch.testing.assert_close(column.bias.data, whole.bias.data)
        column.weight._tp_partition([column.weight, column.bias])
        assert torch.equal(column.weight.data, own) and column.bias.shape == (column.shard_sizes[rank],)

        square = torch.nn.Linear(8, 5)
        row = LinearAllreduce(copy.deepcopy(square), group)
        cols = slice(4 * rank, 4 * rank + 4)
        torch.testing.assert_close(row(x.detach()[:, cols]), square(x.detach()))  # partial sums + bias once
        assert row.bias.shape == (5,) and not getattr(row.bias, "tensor_model_parallel", False)

        # the AutoTP split's own parameters carry the same two methods (a fused q|k|v put back part by part)
        from dsrun.models.gpt import GPT
        from dsrun.tensor_parallel.split import split_for_training

        model = GPT(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
        fused = model.transformer.h[0].attn.c_attn.weight
        before = fused.detach().clone()
        split_for_training(model, group, rank, 2)
        fused.gather_params([fused])
        assert torch.equal(fused.data, before)
        fused._tp_partition([fused])
        assert fused.shape == (before.shape[0] // 2, before.shape[1])
    finally:
        comm.destroy_process_group()


@pytest.mark.timeout(120)
def test_deepspeeds_layers_compute_the_whole_layer_over_two_ranks():
    run_ranks(_layers_on_two_ranks, 2)
