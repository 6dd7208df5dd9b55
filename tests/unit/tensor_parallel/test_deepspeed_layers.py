"""DeepSpeed's AutoTP names on dsrun's AutoTP: ``deepspeed.module_inject.layers`` (``LinearLayer``,
``LinearAllreduce``, ``set_autotp_mode``), ``module_inject.tp_shard``'s shard sizes, the split parameters'
``gather_params`` / ``_tp_partition`` and ``deepspeed.checkpoint.constants``."""
from __future__ import annotations

import copy

import pytest
import torch

from dsrun import comm
from dsrun.checkpoint.constants import DS_AUTOTP_UC_META
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


def test_autotp_walk_hands_each_layer_its_full_name_and_splits_what_it_chose():
    """DeepSpeed's ``partition_config`` walk: ``_replace_with_config(child, full_name)`` per 2-D weight; a module an
    override returns replaces the child; the default chooses the layer for the split (a gathered column output
    stays whole when tied to the embedding, is a ``LinearLayer`` cut 51|50 over two ranks otherwise)."""
    from torch import nn

    from dsrun.compat.module_inject.auto_tp import AutoTP, AutoTPConfig, PartitionType, TPLayerSpec

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Module()
            self.attn.q_proj, self.attn.o_proj = nn.Linear(8, 8), nn.Linear(8, 8)

    class Model(nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed_tokens, self.layers = nn.Embedding(101, 8), nn.ModuleList([Block(), Block()])
            self.lm_head = nn.Linear(8, 101, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    rules = AutoTPConfig(layer_specs=[TPLayerSpec(patterns=[r".*lm_head\.weight$"], partition_type=PartitionType.COLUMN,
                                                  gather_output=True)])
    seen, marker = [], nn.Identity()

    class Recording(AutoTP):
        def _replace_with_config(self, child, name):
            seen.append(name)
            return marker if name == "layers.1.attn.o_proj" else None

    model = Model(tied=False)
    Recording(model, [], "model", None, None, None, partition_config=rules)._replace_module(model)
    assert seen == ["layers.0.attn.q_proj", "layers.0.attn.o_proj", "layers.1.attn.q_proj", "layers.1.attn.o_proj",
                    "lm_head"]  # not the embedding: DeepSpeed slices those apart
    assert model.layers[1].attn.o_proj is marker and isinstance(model.lm_head, nn.Linear)
    for tied, mp_size in ((False, 2), (True, 2)):
        model = Model(tied)
        autotp = AutoTP(model, [], "", None, None, None, partition_config=rules)
        autotp.set_tensor_parallel_config(mp_size, None)
        autotp._replace_module(model)
        if tied:  # a vocabulary-parallel embedding is not built: both stay whole
            assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight
        else:
            assert isinstance(model.lm_head, LinearLayer) and model.lm_head.gather_output
            assert model.lm_head.weight.shape == (51, 8) and type(model.layers[0].attn.q_proj) is nn.Linear


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
        _fused_layers_autotp_and_head_tables(rank, group)
        _autotp_compile_pass(rank, group)
    finally:
        comm.destroy_process_group()


def _autotp_compile_pass(rank: int, group: object) -> None:
    """The AutoTP compile pass over two ranks: a column/row pair and a gathering head compiled as one graph whose
    collectives are graph ops compute the whole block's output and the gradients the uncompiled layers compute."""
    from tests.unit.tensor_parallel.test_compile_pass import compile_with_pass, split_block
    from dsrun.tensor_parallel.graph_collectives import GATHER_OUTPUT_OP

    whole, reference = split_block(group, seed=2)
    _, model = split_block(group, seed=2)
    compiled, graphs = compile_with_pass(model)
    torch.manual_seed(3)  # the same input on both ranks
    x = torch.randn(3, 8, requires_grad=True)
    xc = x.detach().clone().requires_grad_()
    out = compiled(xc)
    torch.testing.assert_close(out, whole(x.detach()))  # the whole block's output, gathered on every rank
    out.pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    torch.testing.assert_close(xc.grad, x.grad)  # the input's gradient summed over the group, as the layers do
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert [n.target for n in graphs[0].graph.nodes].count(GATHER_OUTPUT_OP) == 1 and len(graphs) == 1


def _yuan_and_lm_head(rank: int, group: object) -> None:
    """Yuan 2's shared-QK layers and the LM head cut by its input, over the two ranks of ``group``."""
    from torch import nn

    from dsrun.tensor_parallel.deepspeed_layers import LmHeadLinearAllreduce, Yuan_LinearAllreduce, Yuan_LinearLayer

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    value, o_proj = nn.Linear(8, 8), nn.Linear(8, 5)
    # 4 heads of 2 over 2 ranks: rank r holds heads r and r + 2 (its query pair's value head in each half)
    rows = torch.tensor([2 * rank, 2 * rank + 1, 4 + 2 * rank, 5 + 2 * rank])
    set_num_kv_heads(4)
    try:
        column = Yuan_LinearLayer(copy.deepcopy(value), group, name="v_proj")
        row = Yuan_LinearAllreduce(copy.deepcopy(o_proj), group, name="o_proj")
    finally:
        set_num_kv_heads(None)
    assert torch.equal(column.weight.data, value.weight.data[rows]) and torch.equal(column.bias.data,
                                                                                    value.bias.data[rows])
    torch.testing.assert_close(column(x), value(x)[:, rows])
    torch.testing.assert_close(row(x[:, rows]), o_proj(x))  # the heads' partial outputs summed, the bias once
    for layer in (column, row):
        assert "noncontiguous head groups" in getattr(layer.bias, DS_AUTOTP_UC_META)["conversion"][
            "unsupported_reason"]
        with pytest.raises(RuntimeError, match="noncontiguous head groups"):
            layer.gather_params([layer.weight, layer.bias])
    # the LM head: fresh parameters (a tied embedding stays whole), the whole hidden state in, 7 features as 4 | 3
    head = nn.Linear(7, 5)
    tied, bias = head.weight, head.bias.detach().clone()
    lm_head = LmHeadLinearAllreduce(head, group)
    assert lm_head.weight is not tied and tied.shape == (5, 7) and lm_head._partition_sizes == (4, 3)
    assert torch.equal(lm_head.weight.data, tied.data[:, (slice(0, 4), slice(4, 7))[rank]])
    hidden = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(4))
    reference = hidden @ tied.data.t() + bias
    torch.testing.assert_close(lm_head(hidden), reference)


def _fused_layers_autotp_and_head_tables(rank: int, group: object) -> None:
    """DeepSpeed's fused-weight layers, its AutoTP driver and ALiBi helpers over the two ranks of ``group``."""
    from torch import nn

    from dsrun.tensor_parallel.head_shard import (build_bloom_alibi_tensor, build_mpt_alibi_tensor, get_alibi_mask,
                                                  install_head_sharded_helper)
    from dsrun.tensor_parallel.subparam_layers import (GateUpPack_LinearLayer, SubParamLinearAllreduce,
                                                       SubParamLinearLayer, fused_LinearLayer)

    torch.manual_seed(1)
    x = torch.randn(3, 8)
    # a fused q|k|v of 8, 4, 4 rows: each rank its half of each part, the output the whole layer's part slices
    qkv = nn.Linear(8, 16)
    layer = SubParamLinearLayer(copy.deepcopy(qkv), group, shape=((8, 4, 4), -1), partition_dim=0, name="qkv_proj")
    assert layer._subparam_sizes == (8, 4, 4) and layer._subparam_shard_widths == [[4, 4], [2, 2], [2, 2]]
    rows = torch.cat([torch.arange(4 * rank, 4 * rank + 4), 8 + torch.arange(2 * rank, 2 * rank + 2),
                      12 + torch.arange(2 * rank, 2 * rank + 2)])
    assert torch.equal(layer.weight.data, qkv.weight.data[rows]) and torch.equal(layer.bias.data, qkv.bias.data[rows])
    torch.testing.assert_close(layer(x), qkv(x)[:, rows])
    shard = layer.weight.detach().clone()
    layer.gather_params([layer.weight, layer.bias])  # the bias told apart by identity
    assert torch.equal(layer.weight.data, qkv.weight.data) and torch.equal(layer.bias.data, qkv.bias.data)
    layer._tp_partition([layer.weight, layer.bias])
    assert torch.equal(layer.weight.data, shard)
    # its universal-checkpoint metadata, recorded at construction as DeepSpeed records it
    meta, bias_meta = (getattr(p, DS_AUTOTP_UC_META) for p in (layer.weight, layer.bias))
    assert (meta["sub_param_sizes"], meta["sub_param_shard_widths"], meta["target_partition_shape"]) == \
        ((8, 4, 4), [[4, 4], [2, 2], [2, 2]], (8, 8))
    assert (bias_meta["partition_dim"], bias_meta["sub_param_shape"], bias_meta["target_partition_shape"]) == \
        (0, ((8, 4, 4),), (8,))
    # the row-parallel one: the input features cut per part, the partial outputs summed, the whole bias once
    out = nn.Linear(16, 5)
    row = SubParamLinearAllreduce(copy.deepcopy(out), group, shape=(-1, (8, 4, 4)), partition_dim=1, name="o_proj")
    torch.testing.assert_close(row(torch.randn(3, 16, generator=torch.Generator().manual_seed(2))[:, rows]),
                               out(torch.randn(3, 16, generator=torch.Generator().manual_seed(2))))
    assert row.bias.shape == (5,) and row.weight.shape == (5, 8)
    assert getattr(row.bias, DS_AUTOTP_UC_META)["replicated"] and getattr(row.weight, DS_AUTOTP_UC_META)[
        "partition_type"] == "row"
    # with 3 key/value heads set, each part of 12 is cut 8/4 (whole heads of 4), and gathered back by those widths
    shard_sizes.set_num_kv_heads(3)
    try:
        three = nn.Linear(8, 36)
        cut = SubParamLinearLayer(copy.deepcopy(three), group, shape=((12, 12, 12), -1), name="self_attn.qkv_proj")
        assert cut._subparam_shard_widths == [[8, 4]] * 3 and cut.weight.shape == ((24, 12)[rank], 8)
        cut.gather_params([cut.weight, cut.bias])
        assert torch.equal(cut.weight.data, three.weight.data) and torch.equal(cut.bias.data, three.bias.data)
        # ChatGLM's packed gate|up: each half cut as an MLP weight (evenly, not by heads), put back in order
        pack = nn.Linear(4, 12, bias=False)
        gate_up = GateUpPack_LinearLayer(copy.deepcopy(pack), group)
        assert gate_up.weight.shape == (6, 4) and torch.equal(gate_up.weight.data, torch.cat(
            [pack.weight.data[3 * rank:3 * rank + 3], pack.weight.data[6 + 3 * rank:9 + 3 * rank]]))
        fresh = nn.Parameter(gate_up.weight.data.clone())
        gate_up.gather_params([fresh, None])
        assert torch.equal(fresh.data, pack.weight.data)
        gate_meta = getattr(gate_up.weight, DS_AUTOTP_UC_META)  # the whole sizes outside the cut, as DeepSpeed's
        assert (gate_meta["sub_param_shape"], gate_meta["sub_param_shard_widths"]) == (((6, 6), 4), [[3, 3], [3, 3]])
    finally:
        shard_sizes.set_num_kv_heads(None)

    class GLMBlock(nn.Module):  # a fused q|k|v in GLM's layout: q, k, v thirds
        pass

    glm = nn.Linear(8, 12)
    fused = fused_LinearLayer(copy.deepcopy(glm), group, fused_module=GLMBlock())
    assert fused._subparam_sizes == (4, 4, 4) and torch.equal(fused.weight.data, glm.weight.data[
        torch.cat([torch.arange(2 * rank, 2 * rank + 2) + 4 * p for p in range(3)])])

    class CodeGenBlock(nn.Module):
        pass

    # CodeGen's interleaved layout: not cut over two ranks; built whole, its metadata says why no merge undoes it
    with pytest.raises(ValueError, match=r"codegentype fused qkv layout interleaves or replicates blocks"):
        fused_LinearLayer(copy.deepcopy(glm), group, fused_module=CodeGenBlock())
    whole = fused_LinearLayer(copy.deepcopy(glm), group, skip_partition=True, fused_module=CodeGenBlock())
    assert torch.equal(whole.weight.data, glm.weight.data)
    assert "interleaves" in getattr(whole.weight, DS_AUTOTP_UC_META)["conversion"]["unsupported_reason"]
    with pytest.raises(RuntimeError, match="interleaves"):
        whole.gather_params([whole.weight])
    _yuan_and_lm_head(rank, group)

    # ALiBi: 5 heads over 2 ranks are 3 and 2 (DeepSpeed's cut); each rank's table rows are its own heads'
    class Mpt(nn.Module):
        def build_mpt_alibi_tensor(self, heads, sequence_length, alibi_bias_max=8, device=None):
            return torch.arange(heads, dtype=torch.float32).view(heads, 1, 1).expand(heads, 1, sequence_length)

    mpt, plain = Mpt(), Mpt()
    install_head_sharded_helper(mpt, "build_mpt_alibi_tensor", build_mpt_alibi_tensor, group, num_heads=5,
                                num_kv_heads=5)
    shard_sizes.set_num_kv_heads(1)  # a later process-wide setting does not move the frozen cut
    try:
        mine = mpt.build_mpt_alibi_tensor((3, 2)[rank], 4)
    finally:
        shard_sizes.set_num_kv_heads(None)
    assert torch.equal(mine[:, 0, 0], torch.arange((0, 3)[rank], (3, 5)[rank], dtype=torch.float32))
    assert plain.build_mpt_alibi_tensor(5, 4).shape[0] == 5  # another instance keeps its own method
    # BLOOM's slopes for 4 heads are 2^-2h (h = 1..4), times the positions 0..3; rank r keeps heads 2r, 2r+1
    local = build_bloom_alibi_tensor(torch.ones(1, 4), 2, torch.float32, group, [2, 2], 4)
    heads = torch.arange(2 * rank + 1, 2 * rank + 3, dtype=torch.float32)
    assert torch.equal(local, (2.0 ** (-2 * heads))[:, None, None] * torch.arange(4.0)[None, None, :])
    uneven = build_bloom_alibi_tensor(torch.ones(2, 3), (4, 2)[rank], torch.float32, group, [4, 2], 6)
    assert uneven.shape == (2 * (4, 2)[rank], 1, 3)

    class Baichuan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_head = 5

        def get_alibi_mask(self, tensor, sequence_length):
            return torch.arange(self.n_head, dtype=torch.float32).view(-1, 1, 1).expand(-1, sequence_length,
                                                                                       sequence_length)

    # DeepSpeed's AutoTP driver: rules name a row, a column and a fused q|k|v (SubParamLinearLayer) linear
    from dsrun.tensor_parallel.autotp_config import AutoTPConfig
    from dsrun.tensor_parallel.deepspeed_autotp import AutoTP

    from dsrun.tensor_parallel import groups as tp_groups

    class Custom(nn.Module):  # a linear that is not nn.Linear: a rule naming it splits it as one (DeepSpeed's)
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(6))

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return inputs @ self.weight.t() + self.bias

    _, tp_group = tp_groups._init_tp_mesh_device(tensor_model_parallel_size=2)  # DeepSpeed's groups, no engine
    assert tp_groups.get_tensor_model_parallel_world_size() == 2 and tp_groups._init_tp_mesh_device(2) is None
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 24), nn.Linear(8, 8), Custom())
    whole_model = copy.deepcopy(model)
    rules = AutoTPConfig.from_dict({"use_default_specs": False, "layer_specs": [
        {"patterns": [r"0\.weight$"], "partition_type": "row"},
        {"patterns": [r"1\.weight$", r"4\.weight$"], "partition_type": "column"},
        {"patterns": [r"2\.weight$"], "partition_type": "column", "shape": [[8, 8, 8], -1], "partition_dim": 0}]})
    autotp = AutoTP(module=model, all_reduce_linears=[], prefix="", state_dict=None, linear_layer_setting=None,
                    orig_layer_impl=None, partition_config=rules)
    autotp.set_tensor_parallel_config(2, tp_group)
    autotp.update_linear_policies()
    autotp._replace_module(model)
    assert [type(m).__name__ for m in model] == ["LinearAllreduce", "LinearLayer", "SubParamLinearLayer", "Linear",
                                                 "LinearLayer"]
    assert model[2]._subparam_sizes == (8, 8, 8) and model[2].weight.shape == (12, 8)
    torch.testing.assert_close(model[0](x[:, 4 * rank:4 * rank + 4]), whole_model[0](x))
    torch.testing.assert_close(model[4](x), whole_model[4](x)[:, 3 * rank:3 * rank + 3])
    with pytest.raises(ValueError, match="is not a linear class dsrun's split cuts"):
        AutoTP(model, [], "", None, (nn.LayerNorm,), None).update_linear_policies()
    shard_sizes.set_num_kv_heads(3)  # 12 heads in 3 key/value groups over 2 ranks: 8 and 4; an MLP's 12: 6 and 6
    try:
        attention, mlp = nn.Module(), nn.Module()
        attention.num_heads = mlp.hidden_size = 12
        autotp.update_mp_params(attention, "model.layers.0.self_attn")
        autotp.update_mp_params(mlp, "model.layers.0.mlp")
        autotp.update_mp_params(attention, "model.layers.0.self_attn")  # once per module
    finally:
        shard_sizes.set_num_kv_heads(None)
    assert (attention.num_heads, mlp.hidden_size) == ((8, 4)[rank], 6)
    assert AutoTP.get_model_num_kv_heads(type("C", (), {"num_key_value_heads": 2, "num_attention_heads": 8})()) == 2

    baichuan = Baichuan()
    install_head_sharded_helper(baichuan, "get_alibi_mask", get_alibi_mask, group, num_heads=5, num_kv_heads=5)
    baichuan.n_head = (3, 2)[rank]  # AutoTP's per-rank head count; the original still builds all 5 heads
    mask = baichuan.get_alibi_mask(None, 3)
    assert mask.shape == ((3, 2)[rank], 3, 3) and mask[0, 0, 0] == (0, 3)[rank]


@pytest.mark.timeout(120)
def test_deepspeeds_layers_compute_the_whole_layer_over_two_ranks():
    run_ranks(_layers_on_two_ranks, 2)
