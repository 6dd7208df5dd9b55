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
from dsrun.tensor_parallel import (AutoTPConfig, AutoTPFeature, ColumnParallelLinear, RowParallelLinear,
                                   TensorParallelLinear, refuse_group_beside_mpu, reset_tp_model_init,
                                   split_by_specs, split_for_training, tp_model_init)
from dsrun.tensor_parallel.spec_split import meta_split_for
from dsrun.tensor_parallel.split import set_keep_module_on_host, universal_checkpoint_info
from dsrun.utils.errors import ConfigError
from tests.helpers import run_ranks
from tests.integration._inference_models import dsrun_gpt, hf_model


@pytest.fixture(autouse=True)
def _forget_tp_model_init():
    reset_tp_model_init()
    yield
    reset_tp_model_init()
    set_keep_module_on_host(False)  # process-wide, as DeepSpeed keeps it


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
    assert AutoTPFeature.build(_config(zero_optimization={"stage": 3})).size == 2  # with ZeRO-3 too (DeepSpeed's)
    with pytest.raises(ConfigError, match="vocab_parallel_lm_head: cuts the vocabulary over the tensor-parallel "
                                          "ranks, and autotp_size asks for none"):
        AutoTPFeature.build(_config(tensor_parallel={"vocab_parallel_lm_head": True}))
    model = torch.nn.Linear(2, 2)
    assert tp_model_init(model, tp_size=2, dtype=torch.bfloat16) is model  # records; splits at initialize
    with pytest.raises(ValueError, match="Conflicting tp_model_init"):
        tp_model_init(model, tp_size=4, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="Conflicting dtype: config uses torch.float16 but tp_model_init requested "
                                          "torch.bfloat16"):
        AutoTPFeature.build(_config(fp16={"enabled": True}))
    assert AutoTPFeature.build(load_ds_config({"train_batch_size": 2, "bf16": {"enabled": True}})).size == 2
    with pytest.raises(ConfigError, match="tp_model_init\\(tp_size=2\\)"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 4}))


def test_tensor_parallel_dtype_must_be_the_dtype_the_run_trains_in():
    """``tensor_parallel.dtype``: given, it must name the dtype the precision section gives the split model (fp32
    without fp16/bf16) and tp_model_init's dtype; left out, its default (fp16) asks for nothing."""
    assert AutoTPFeature.build(_config(bf16={"enabled": True})).size == 2  # the default: no request
    assert AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "dtype": "fp32"})).size == 2
    assert AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "dtype": "bf16"},
                                       bf16={"enabled": True})).size == 2
    with pytest.raises(ConfigError, match=r"^tensor_parallel.dtype: is bf16, but the run trains the split model in "
                                          r"fp32 .*enable the bf16 section, or drop the key\)$"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "dtype": "bf16"}))
    with pytest.raises(ConfigError, match="tensor_parallel.dtype: is fp16, but the run trains the split model in bf16"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "dtype": "fp16"}, bf16={"enabled": True}))
    tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"Conflicting tensor_parallel.dtype in config \(fp32\) and tp_model_init "
                                          r"\(torch.float16\)"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "dtype": "fp32"}))


class _Mpu:
    def __init__(self, group=None):
        self.group = group

    def get_model_parallel_group(self):
        return self.group


def test_given_groups_deepspeed_refuses_together_are_refused():
    """``tensor_parallel.tp.tp_group`` / ``tp.mpu`` (objects, in a dict config): kept as given for the split (which
    checks them against the layout: tests/integration/test_autotp_training.py); a group beside an mpu, a group
    unlike tp_model_init's and an mpu without DeepSpeed's getter are refused, one line each."""
    group, other = object(), object()
    feature = AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "tp": {"tp_group": group}}))
    assert feature.given is group and feature.given_as == "tensor_parallel.tp.tp_group"
    mpu = _Mpu(group)
    feature = AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "tp": {"mpu": mpu}}))
    assert feature.given is group and feature.given_mpu is mpu
    with pytest.raises(ConfigError, match=r"^tensor_parallel.tp.mpu: is given beside a tp_group"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "tp": {"mpu": mpu, "tp_group": group}}))
    with pytest.raises(ConfigError, match=r"^tensor_parallel.tp.mpu: a object has no get_model_parallel_group\(\)"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "tp": {"mpu": object()}}))
    tp_model_init(torch.nn.Linear(2, 2), tp_size=2, dtype=torch.float32, tp_group=other)
    with pytest.raises(ConfigError, match="Conflicting tensor_parallel.tp.tp_group in config and tp_model_init"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "tp": {"tp_group": group}}))
    assert AutoTPFeature.build(_config()).given is other  # tp_model_init's own group, as before
    with pytest.raises(ValueError, match="tp_model_init provided tp_group; deepspeed.initialize must not receive mpu"):
        refuse_group_beside_mpu(_Mpu(other))  # initialize(mpu=...) after it: DeepSpeed's ValueError
    refuse_group_beside_mpu(None)


def test_the_injection_policy_tuple_splits_each_block_by_its_row_parallel_names():
    """``injection_policy_tuple`` (DeepSpeed's policy tuple): the linears it names are each block's row-parallel
    ones, the block's others column-parallel, the rest of the model whole. GPT-J's MLP output is ``fc_out``, which
    the automatic reading does not take for an output projection; named, it splits, and the slices merge back."""
    pytest.importorskip("transformers")
    model = hf_model("gptj")
    with pytest.raises(ConfigError, match="mlp.fc_in: no output projection follows this linear"):
        split_for_training(copy.deepcopy(model), None, 0, 2)
    rows = AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "injection_policy_tuple": [
        "attn.out_proj", "fc_out"]})).rows  # a name's tail names it too
    assert rows == ("attn.out_proj", "fc_out")
    shards, layouts = [], []
    for rank in range(2):
        shard = copy.deepcopy(model)
        layouts.append(split_for_training(shard, None, rank, 2, rows=rows))
        shards.append(shard)
    block = shards[0].transformer.h[1]
    assert isinstance(block.attn.out_proj, RowParallelLinear) and isinstance(block.mlp.fc_out, RowParallelLinear)
    assert all(isinstance(m, ColumnParallelLinear) for m in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj,
                                                             block.mlp.fc_in))
    assert type(shards[0].lm_head) is torch.nn.Linear and "lm_head.weight" not in layouts[0].splits
    assert block.mlp.fc_in.weight.shape == (64, 32) and block.mlp.fc_out.weight.shape == (32, 64)
    merged = merge_module_states([s.state_dict() for s in shards], layouts[0].splits)
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    # the memory estimator splits a meta-device model by the tuple too (GPT-J's own plan would cut its LM head)
    with torch.device("meta"):
        meta = type(model)(model.config)
    meta_split_for({"ds": {"tensor_parallel": {"autotp_size": 2, "injection_policy_tuple": list(rows)}}})(meta, 2)
    assert isinstance(meta.transformer.h[0].mlp.fc_out, RowParallelLinear) and type(meta.lm_head) is torch.nn.Linear
    with pytest.raises(ConfigError, match=r"^tensor_parallel.injection_policy_tuple: 'mlp.down_proj' names no linear "
                                          r"of the model's blocks \(they hold attn.k_proj, "):
        split_for_training(copy.deepcopy(model), None, 0, 2, rows=("attn.out_proj", "mlp.down_proj"))
    with pytest.raises(ConfigError, match="injection_policy_tuple: got \\[3\\]; expected the names"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "injection_policy_tuple": [3]}))
    with pytest.raises(ConfigError, match="injection_policy_tuple: names the row-parallel linears beside "
                                          "partition_config / preset_model's rules"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "injection_policy_tuple": ["o_proj"],
                                                     "preset_model": "llama"}))


def test_keep_module_on_host_keeps_the_slices_as_views_of_the_host_weights():
    """``keep_module_on_host`` (DeepSpeed's ``TensorParallel_Layer.move``), on a CPU where the host is the
    accelerator: false, every slice is a tensor of its own, exactly its bytes, and no slice keeps the whole weight
    it was cut from alive; true, the slices stay where the model is, not copied: a cut along the first dimension
    (GPT-2's row-parallel ``Conv1D`` weights: their input rows) is a view of the whole weight, materialising no
    bytes (and keeping the whole weight's), until the engine moves the module."""
    pytest.importorskip("transformers")
    model = hf_model("gpt2")
    held = {}
    for keep in (False, True):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "keep_module_on_host": keep}))
        shard = copy.deepcopy(model)
        before = {n: p.untyped_storage().data_ptr() for n, p in shard.named_parameters()}
        layout = split_for_training(shard, None, 1, 2)
        params = dict(shard.named_parameters())
        new_bytes = sum(params[n].untyped_storage().nbytes() for n in layout.splits
                        if params[n].untyped_storage().data_ptr() != before[n])
        views = {n for n in layout.splits if params[n].untyped_storage().data_ptr() == before[n]}
        held[keep] = (new_bytes, views, {params[n].device.type for n in layout.splits})
        if not keep:
            assert all(params[n].untyped_storage().nbytes() == params[n].numel() * 4 for n in layout.splits)
    split_bytes = sum(torch.Size(layout.whole[n]).numel() * 4 // 2 for n in layout.splits)
    assert held[False] == (split_bytes, set(), {"cpu"})
    # cut along their first dimension, in one part: the row-parallel weights' input rows, c_fc's bias (c_attn's
    # q|k|v parts are cut one by one and put together: a tensor of its own either way)
    first = {f"transformer.h.{i}.{m}.c_proj.weight" for i in range(2) for m in ("attn", "mlp")} | \
        {f"transformer.h.{i}.mlp.c_fc.bias" for i in range(2)}
    assert held[True][1] == first and held[True][2] == {"cpu"}
    assert held[True][0] == split_bytes - sum(torch.Size(layout.whole[n]).numel() * 4 // 2 for n in first)


def test_the_gpt_tp_recipe_counts_data_parallel_ranks_only():
    run = resolve_run(compose_runspec(["+recipe=gpt_tp"]))
    assert run.ds.tensor_parallel.autotp_size == 2 and run.world_size == 2
    assert run.ds.train_batch_size == run.ds.train_micro_batch_size_per_gpu  # 2 ranks, one data-parallel rank
    run = resolve_run(compose_runspec(["+recipe=gpt_tp", "launcher.num_procs=4"]))
    assert run.ds.train_batch_size == 2 * run.ds.train_micro_batch_size_per_gpu
    with pytest.raises(ConfigError, match="ds.tensor_parallel.autotp_size: 2 does not divide the 3 ranks"):
        resolve_run(compose_runspec(["+recipe=gpt_tp", "launcher.num_procs=3"]))


# ------------------------------------------------------------------ partition_config / preset_model (split by rules)
GPT2_RULES = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.attn\.c_attn\.weight$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0},
    {"patterns": [r".*\.(attn|mlp)\.c_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.mlp\.c_fc\.weight$"], "partition_type": "column"}]}


def _split_by(model: torch.nn.Module, rules, size: int = 2):
    shards, layouts = [], []
    for rank in range(size):
        shard = copy.deepcopy(model)
        layouts.append(split_by_specs(shard, rules, None, rank, size))
        shards.append(shard)
    return shards, layouts


@pytest.mark.parametrize("name,section", [("llama", {"preset_model": "llama"}),
                                          ("gpt2", {"partition_config": GPT2_RULES})])
def test_rules_naming_the_automatic_split_cut_the_same_slices(name, section):
    """A preset (Llama) or custom rules (GPT-2's Conv1D, its fused q|k|v as ``shape: [3, -1]``) that name what the
    automatic split finds cut every rank's parameters exactly as it does, and halve the heads alike."""
    pytest.importorskip("transformers")
    model = hf_model(name)
    feature = AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, **section}))
    assert isinstance(feature.rules, AutoTPConfig) and feature.rules.tp_size == 2
    by_rules, rule_layouts = _split_by(model, feature.rules)
    automatic, auto_layouts = _split(model)
    assert rule_layouts[0].splits == auto_layouts[0].splits and rule_layouts[0].splits
    for ours, theirs in zip(by_rules, automatic):
        mine, other = ours.state_dict(), theirs.state_dict()
        assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)
        kinds = [[(n, m.row_parallel) for n, m in shard.named_modules() if isinstance(m, TensorParallelLinear)]
                 for shard in (ours, theirs)]
        assert kinds[0] == kinds[1] and kinds[0]
    if name == "gpt2":
        assert by_rules[1].transformer.h[0].attn.num_heads == 2
        info = universal_checkpoint_info(by_rules[0], rule_layouts[0])  # DeepSpeed's model-level schema
        assert {"patterns": [r"^transformer\.h\.0\.attn\.c_attn\.weight$"], "shape": [-1, (32, 32, 32)],
                "partition_dim": 1} in info["parameter_with_sub_params"]
        assert r"^transformer\.h\.1\.mlp\.c_proj\.weight$" in info["parameter_with_row_parallelism_patterns"]
        assert r"^transformer\.h\.1\.mlp\.c_proj\.bias$" in info["tp_replicated_parameter_patterns"]


def test_rules_leave_unmatched_and_skipped_linears_whole_and_gather_outputs():
    """No Transformer blocks needed: a skip-all rule keeps every linear whole; a column rule with gather_output
    puts the whole output back on each rank (one process: the group of one rank gathers nothing); strict_mode
    refuses a linear no rule names."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    skip_all = AutoTPConfig.from_dict({"layer_specs": [{"patterns": [r".*\.weight$"], "partition_type": "skip"}]})
    shards, layouts = _split_by(model, skip_all)
    assert layouts[0].splits == {} and all(torch.equal(a, b) for a, b in zip(shards[1].parameters(),
                                                                            model.parameters()))
    gathered = AutoTPConfig.from_dict({"layer_specs": [{"patterns": ["0.weight"], "gather_output": True}]})
    shards, layouts = _split_by(model, gathered)
    assert layouts[1].splits == {"0.weight": (0, 1), "0.bias": (0, 1)}
    assert shards[1][0].weight.shape == (3, 8) and torch.equal(shards[1][0].weight, model[0].weight[3:])
    assert shards[1][2].weight.shape == (4, 6)  # matched by no rule: whole
    with pytest.raises(ConfigError, match="partition_config: 2.weight: no layer spec matches this linear"):
        split_by_specs(copy.deepcopy(model), AutoTPConfig.from_dict({"strict_mode": True, "layer_specs": [
            {"patterns": ["0.weight"]}]}), None, 0, 2)


@pytest.mark.parametrize("section,message", [
    ({"preset_model": "lama"}, "tensor_parallel.preset_model: got 'lama'; one of"),
    ({"partition_config": {"layer_spec": []}}, "tensor_parallel.partition_config.layer_spec: is not a key"),
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}},
     r"partition_config.layer_specs\[0\].partition_type: got 'diagonal'"),
    ({"partition_config": {"layer_specs": [{"patterns": ["("]}]}}, "is not a regular expression"),
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "shape": [2, 0]}]}}, "shape: entry 0"),
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "shape": [2, [1, 1]]}]}},
     "shape: nested tuple only allowed at partition_dim=0"),
    ({"partition_config": {"layer_specs": [{"patterns": ["x"], "grad_allreduce": True}]}},
     "grad_allreduce: applies to skip specs only"),
    ({"vocab_parallel_ce_backend": "liger"}, "tensor_parallel.vocab_parallel_ce_backend: got 'liger': Liger's fused "
     "kernel is a Triton")])
def test_bad_partition_config_values_are_refused_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message) as err:
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, **section}))
    assert "\n" not in str(err.value)


def test_an_embedding_a_rule_names_is_cut_along_its_hidden_columns_as_deepspeed_cuts_it():
    """DeepSpeed's ``_slice_embedding``: an embedding of 10 rows, 7 wide, over 2 ranks keeps every row and
    DeepSpeed's shard sizes of its hidden columns (4 and 3) with the row-partition metadata; a row-parallel linear
    after it sums the ranks' partial outputs into the whole model's output; the slices merge back; the layers are
    named by their module path; ``AutoTP._slice_embedding`` cuts the same and leaves a replaced module alone."""
    from dsrun.checkpoint.autotp_meta import collect_autotp_universal_checkpoint_info
    from dsrun.compat.module_inject.auto_tp import AutoTP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 7, padding_idx=0), torch.nn.Linear(7, 5))
    rules = AutoTPConfig.from_dict({"use_default_specs": False, "layer_specs": [
        {"patterns": [r"^0\.weight$"], "partition_type": "column"},
        {"patterns": [r"^1\.weight$"], "partition_type": "row"}]})
    shards, layouts = _split_by(model, rules)
    ids = torch.tensor([[0, 3, 9, 4]])
    partial = [torch.nn.functional.linear(shard[0](ids), shard[1].weight) for shard in shards]
    torch.testing.assert_close(partial[0] + partial[1] + model[1].bias, model(ids), rtol=1e-6, atol=1e-6)
    for rank, shard in enumerate(shards):
        assert isinstance(shard[0], torch.nn.Embedding) and shard[0].weight.shape == (10, (4, 3)[rank])
        assert shard[0].padding_idx == 0 and shard[1].name == "1" and shard[0].name == "0"
        info = collect_autotp_universal_checkpoint_info(shard)
        assert "^0\\.weight$" in info["parameter_with_row_parallelism_patterns"]
        assert "^0\\.weight$" not in info["tp_replicated_parameter_patterns"]
    assert layouts[0].splits["0.weight"] == (1, ((4, 3),))
    merged = merge_module_states([s.state_dict() for s in shards], layouts[0].splits)
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())

    autotp = object.__new__(AutoTP)  # as DeepSpeed's test builds it: only the group and its size
    autotp.mp_group, autotp.mp_size = None, 2
    embedding = copy.deepcopy(model[0])
    sliced = autotp._slice_embedding(embedding, "embed_tokens", False)
    assert torch.equal(sliced.weight, model[0].weight[:, :4]) and autotp._slice_embedding(embedding, "x") is None
    meta = sliced.weight.ds_autotp_universal_checkpoint_meta
    assert (meta["partition_type"], meta["partition_dim"], meta["partition_sizes"]) == ("row", 1, (4, 3))
    with pytest.raises(ValueError, match="embedding e has max_norm=1.0"):
        autotp._slice_embedding(torch.nn.Embedding(4, 4, max_norm=1.0), "e")


@pytest.mark.parametrize("spec,size,message", [
    ({"patterns": ["0.weight"], "shape": [[5, 1], -1]}, 2, r"its 6 features in 2 part\(s\) cut over tp_size=2 leave "
     "some ranks nothing"),
    ({"patterns": ["0.weight"], "shape": [[4, 3], -1]}, 2, "sub-parameter sizes \\[4, 3\\] do not add up to 6"),
    ({"patterns": ["0.weight"], "shape": [2, -1, 8]}, 2, "logical shapes of more than"),
    ({"patterns": ["2.weight"], "partition_type": "row", "shape": [5, -1]}, 2, "does not fit its weight"),
    ({"patterns": ["0.weight"], "shape": [4, -1]}, 2, "do not split into 4 equal sub-parameters"),
    ({"patterns": ["2.weight"]}, 5, r"its 4 features in 1 part\(s\) cut over tp_size=5 leave some ranks nothing"),
    ({"patterns": ["0.weight"], "shape": [2, -1], "gather_output": True}, 2, "gather_output with fused"),
    ({"patterns": ["attn.q.weight"]}, 2, "attn.q: its 3 heads of 2 do not split over tensor_parallel.autotp_size=2 "
     "\\(and the model.s config names no key/value head count; attention is cut on whole heads"),
    ({"patterns": ["emb.weight"]}, 2, "emb.weight: is tied to head.weight, which would be cut with it along its "
     "hidden columns"),
    ({"patterns": ["head.weight"]}, 2, "is tied to emb.weight")])
def test_rules_a_split_cannot_follow_are_refused_naming_the_linear(spec, size, message):
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    model.emb, model.head, model.attn = torch.nn.Embedding(5, 8), torch.nn.Linear(8, 5, bias=False), torch.nn.Module()
    model.head.weight = model.emb.weight
    model.attn.head_dim, model.attn.q = 2, torch.nn.Linear(8, 6)  # 3 heads of 2: 3 features a rank would cut one
    with pytest.raises(ConfigError, match=message):
        split_by_specs(model, AutoTPConfig.from_dict({"layer_specs": [spec]}), None, 0, size)


def test_an_uneven_cut_gives_the_first_ranks_one_more_and_merges_back():
    """DeepSpeed's shard sizes in grains of one: 4 output features over 3 ranks are 2, 1, 1; the slices merge
    back into the weight, and the gathered layer knows every rank's width."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    rules = AutoTPConfig.from_dict({"layer_specs": [{"patterns": ["2.weight"], "gather_output": True}]})
    shards, layouts = _split_by(model, rules, size=3)
    assert [s[2].weight.shape[0] for s in shards] == [2, 1, 1] and shards[0][2].shard_sizes == [2, 1, 1]
    merged = merge_module_states([s.state_dict() for s in shards], layouts[0].splits)
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    for rank in range(3):
        assert torch.equal(slice_dim(model[2].weight, 0, 1, rank, 3), shards[rank][2].weight)


def test_a_hugging_face_tp_plan_is_read_and_converted_as_deepspeed_does():
    """Llama's plan (its config's ``base_model_tp_plan`` and the class's ``lm_head``) splits the blocks as the
    automatic split does and cuts the LM head's vocabulary (97 rows: 49 and 48), gathering its output; a
    ``model.``-prefixed duplicate of a pattern given already is dropped; an unknown style refuses the plan."""
    pytest.importorskip("transformers")
    from dsrun.compat.module_inject.tp_plan_converter import TPPlanConverter
    from dsrun.compat.runtime.tensor_parallel.config import _get_hf_tp_plan
    from dsrun.tensor_parallel.hf_plan import rules_from_hf_plan

    model = hf_model("llama")
    plan = _get_hf_tp_plan(model)
    assert plan["layers.*.self_attn.q_proj"] == "colwise" and plan["lm_head"] == "colwise_gather_output"
    shards, layouts = _split_by(model, rules_from_hf_plan(model, 2))
    automatic = _split(model)[1][0].splits
    assert layouts[0].splits == {**automatic, "lm_head.weight": (0, 1)}
    assert [s.lm_head.weight.shape[0] for s in shards] == [49, 48] and shards[1].lm_head.shard_sizes == [49, 48]
    merged = merge_module_states([s.state_dict() for s in shards], layouts[0].splits)
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    info = universal_checkpoint_info(shards[1], layouts[1])
    assert info["vocabulary_parameter_patterns"] == [r"^lm_head\.weight$"] and info["original_vocab_size"] == 97
    assert r"^model\.layers\.0\.self_attn\.o_proj\.weight$" in info["parameter_with_row_parallelism_patterns"]
    assert r"^model\.norm\.weight$" in info["tp_replicated_parameter_patterns"]
    model._tp_plan = {"model.layers.*.mlp.up_proj": "rowwise", "lm_head": "colwise"}
    assert _get_hf_tp_plan(model)["lm_head"] == "colwise" and "model.layers.*.mlp.up_proj" not in _get_hf_tp_plan(model)
    specs = TPPlanConverter.convert({"layers.*.q": "colwise_rep", "norm": "replicated_with_grad_allreduce"})
    assert specs[0].gather_output and specs[0].matches("model.layers.3.q.weight")
    assert specs[1].grad_allreduce and specs[1].patterns == [r".*norm\.weight$"]
    with pytest.raises(ValueError, match="local_colwise"):
        TPPlanConverter.convert({"layers.*.q": "local_colwise"})


def test_deepspeeds_rule_objects_through_the_alias():
    """``deepspeed.module_inject.autotp_config``'s names, as DeepSpeed's tests build them."""
    from dsrun.compat.module_inject.autotp_config import (AutoTPConfig as Config, AutoTPPresets, PartitionType,
                                                          TPLayerSpec, merge_autotp_configs)

    spec = TPLayerSpec(patterns=[r".*\.qkv\.weight$"], partition_type="column", shape=[[4, 2, 2], -1])
    assert spec.partition_type is PartitionType.COLUMN and spec.shape == ((4, 2, 2), -1)
    assert spec.get_sub_param_sizes() == (4, 2, 2) and spec.get_num_sub_params() == 3
    assert TPLayerSpec(patterns=["x"], partition_type=PartitionType.ROW).get_partition_dim() == 1
    custom = Config(tp_size=2, layer_specs=[spec], use_default_specs=True)
    merged = merge_autotp_configs(AutoTPPresets.llama(), custom)
    assert merged.layer_specs[0] is spec and merged.tp_size == 2
    assert merged.find_matching_spec("model.layers.3.mlp.down_proj.weight").partition_type is PartitionType.ROW
    assert merged.find_matching_spec("model.layers.3.mlp.down_proj.weight", "llama") is not None
    assert TPLayerSpec(patterns=["x"], model_types=["qwen2"]).matches("x", "llama") is False
    assert AutoTPPresets.get_preset("nope") is None and AutoTPPresets.get_preset("Phi3") is not None


def test_a_fused_gqa_projection_is_cut_per_part_on_whole_heads_and_the_mlp_in_grains():
    """``shape: [[16, 8, 8], -1]`` (4 query and 2 key/value heads of 4 in one q|k|v): each rank keeps its heads of
    each part (q 8, k 4, v 4 rows) and its head counts halve; ``tp.tp_grain_size: 32`` cuts the MLP's 48 features
    32 and 16 (the tail that fills no grain to the last rank, DeepSpeed's cut), the row projection alike; the
    slices merge back into the model; the universal info carries DeepSpeed's per-rank sub-parameter widths. At
    TP=4 the 2 key/value heads do not split: refused naming them."""
    from tests.integration._autotp_jobs import GQA_TP, FusedGQAModel

    model = FusedGQAModel()
    feature = AutoTPFeature.build(_config(tensor_parallel=GQA_TP))
    assert feature.grain == 32
    shards = []
    for rank in range(2):
        shard = copy.deepcopy(model)
        layout = split_by_specs(shard, feature.rules, None, rank, 2, grain=feature.grain)
        shards.append((shard, layout))
    qkv = model.attn.qkv_proj.weight
    for rank, (shard, layout) in enumerate(shards):
        mine = shard.attn.qkv_proj.weight
        assert mine.shape == (16, 16) and (shard.attn.num_heads, shard.attn.num_key_value_heads) == (2, 1)
        assert torch.equal(mine, torch.cat([qkv[8 * rank:8 * rank + 8], qkv[16 + 4 * rank:20 + 4 * rank],
                                            qkv[24 + 4 * rank:28 + 4 * rank]]))
        width = (32, 16)[rank]
        assert shard.mlp.up_proj.weight.shape == (width, 16) and shard.mlp.down_proj.weight.shape == (16, width)
        assert shard.mlp.gate_proj.shard_sizes == [32, 16]
    splits = shards[0][1].splits
    assert splits["attn.qkv_proj.weight"] == (0, ((8, 8), (4, 4), (4, 4)))
    assert splits["mlp.down_proj.weight"] == (1, ((32, 16),)) and "lm_head.weight" not in splits
    merged = merge_module_states([s.state_dict() for s, _ in shards], splits)
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    info = universal_checkpoint_info(shards[1][0], shards[1][1])
    assert info["sub_param_shard_widths"] == {rf"^attn\.qkv_proj\.{p}$": [[8, 8], [4, 4], [4, 4]]
                                              for p in ("weight", "bias")}
    assert {"patterns": [r"^attn\.qkv_proj\.weight$"], "shape": [(16, 8, 8), -1], "partition_dim": 0} in \
        info["parameter_with_sub_params"]
    with pytest.raises(ConfigError, match=r"attn.qkv_proj: its 2 heads of 4 do not split over "
                                          r"tensor_parallel.autotp_size=4"):
        split_by_specs(copy.deepcopy(model), feature.rules, None, 0, 4)
    with pytest.raises(ConfigError, match="tensor_parallel.tp.tp_size: is 4, but the tensor-parallel degree is 2"):
        AutoTPFeature.build(_config(tensor_parallel={"autotp_size": 2, "tp": {"tp_size": 4}}))


def test_heads_that_do_not_divide_are_cut_by_key_value_groups_as_deepspeed_cuts_them():
    """Llama's 2 key/value heads (of 4 query heads, 8 wide) over 4 ranks: DeepSpeed's cut by key/value groups
    gives ranks 0 and 1 one group each (2 query heads, 1 key/value head) and ranks 2 and 3 none, by the Hugging
    Face plan and by the automatic reading alike; the row projection's input is cut the same way, the MLP
    evenly, and the slices merge back into the model. A model whose config names no key/value head count has its
    attention refused where its heads do not divide (a cut inside a head)."""
    pytest.importorskip("transformers")
    from dsrun.tensor_parallel.hf_plan import rules_from_hf_plan
    from tests.integration._autotp_jobs import GQA_TP, FusedGQAModel

    model = hf_model("llama")
    for split in (lambda m, r: split_by_specs(m, rules_from_hf_plan(m, 4), None, r, 4),
                  lambda m, r: split_for_training(m, None, r, 4)):
        shards, layouts = [], []
        for rank in range(4):
            shards.append(copy.deepcopy(model))
            layouts.append(split(shards[-1], rank))
            attn = shards[-1].model.layers[0].self_attn
            rows = (16, 16, 0, 0)[rank]
            assert attn.q_proj.weight.shape == (rows, 32) and attn.k_proj.weight.shape == (rows // 2, 32)
            assert attn.o_proj.weight.shape == (32, rows) and shards[-1].model.layers[0].mlp.up_proj.weight.shape == (16, 32)
            # DeepSpeed's layer name: the module's path, which its shard sizes are asked under
            assert attn.q_proj.name == "model.layers.0.self_attn.q_proj"
            assert shards[-1].model.layers[0].mlp.down_proj.name == "model.layers.0.mlp.down_proj"
        assert layouts[0].splits["model.layers.0.self_attn.k_proj.weight"] == (0, ((8, 8, 0, 0),))
        merged = merge_module_states([s.state_dict() for s in shards], layouts[0].splits)
        assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    # projections of a module naming no head width, the model's config 6 key/value heads: DeepSpeed's
    # get_shard_size cuts them by key/value groups too (2/2/1/1 groups of 4 rows), the MLP in grains
    gqa, block = torch.nn.Module(), torch.nn.Module()
    gqa.config, gqa.layers = type("C", (), {"num_key_value_heads": 6})(), torch.nn.ModuleList([block])
    block.self_attn, block.mlp = torch.nn.Module(), torch.nn.Module()
    block.self_attn.q_proj, block.self_attn.o_proj = (torch.nn.Linear(24, 24, bias=False) for _ in range(2))
    block.mlp.up_proj, block.mlp.down_proj = (torch.nn.Linear(24, 24, bias=False) for _ in range(2))
    for rank in range(4):
        shard = copy.deepcopy(gqa)
        split_for_training(shard, None, rank, 4)
        attn, mlp = shard.layers[0].self_attn, shard.layers[0].mlp
        assert attn.q_proj.weight.shape == ((8, 8, 4, 4)[rank], 24) == attn.o_proj.weight.shape[::-1]
        assert mlp.up_proj.weight.shape == (6, 24) == mlp.down_proj.weight.shape[::-1]
    from dsrun.tensor_parallel.shard_sizes import set_tp_grain_size

    feature = AutoTPFeature.build(_config(tensor_parallel=GQA_TP))
    set_tp_grain_size(1)  # build sets the grain process-wide, as DeepSpeed does
    with pytest.raises(ConfigError, match=r"attn.qkv_proj: its 4 heads of 4 do not split over "
                                          r"tensor_parallel.autotp_size=3 \(and the model's config names no"):
        split_by_specs(copy.deepcopy(FusedGQAModel()), feature.rules, None, 0, 3)


def _qwen3_on_three_ranks(rank: int, world_size: int) -> dict[int, dict[str, object]]:
    """Qwen3 (8 query heads, 4 or 2 key/value heads of 4) at TP=3, each rank's model drawn from its own seed
    (DeepSpeed's tests leave the ranks unseeded): what each rank holds, and the group's forward and backward
    against the unsplit model its slices gather into."""
    import transformers

    import dsrun

    out: dict[int, dict[str, object]] = {}
    for kv in (4, 2):
        config = transformers.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=20, num_hidden_layers=1,
                                          num_attention_heads=8, num_key_value_heads=kv, head_dim=4,
                                          max_position_embeddings=16)
        torch.manual_seed(rank)  # a different model on every rank
        model = transformers.AutoModelForCausalLM.from_config(config)
        own = {name: p.detach().clone() for name, p in model.named_parameters()}
        engine, *_ = dsrun.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 3},
            "zero_optimization": {"stage": 0}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        splits = engine.features.get(AutoTPFeature).layout.splits
        params = dict(model.named_parameters())
        attn = model.model.layers[0].self_attn
        ids = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(1))
        result = engine(input_ids=ids, labels=ids)
        engine.backward(result.loss)
        grads = {name: p.grad.clone() for name, p in params.items()}
        rows = (attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.o_proj.weight.shape[1],
                model.model.layers[0].mlp.up_proj.weight.shape[0])
        mine = {name: p.detach().clone() for name, p in params.items()}
        for name in splits:
            params[name].gather_params([params[name]])
        whole = {name: p.detach().clone() for name, p in params.items()}
        unsplit = transformers.AutoModelForCausalLM.from_config(config)
        unsplit.load_state_dict(model.state_dict())
        reference = unsplit(input_ids=ids, labels=ids)
        reference.loss.backward()
        ref_grads = {name: p.grad for name, p in unsplit.named_parameters()}
        out[kv] = {
            "rows": rows,
            "num_key_value_groups": attn.num_key_value_groups,
            "own_slices": all(torch.equal(mine[n], slice_dim(own[n], dim, parts, rank, 3))
                              for n, (dim, parts) in splits.items()),
            "whole": {n: whole[n] for n in params if n not in splits},
            "own_embedding": own["model.embed_tokens.weight"].sum().item(),
            "logits": (result.logits - reference.logits).abs().max().item(),
            "grads": max((grads[n] - (slice_dim(ref_grads[n], *splits[n], rank, 3) if n in splits else ref_grads[n]))
                         .abs().amax(dim=None).item() if grads[n].numel() else 0.0 for n in params),
            "scale": max(reference.logits.abs().max().item(), max(g.abs().max().item() for g in ref_grads.values()))}
        engine.destroy()
    return out


@pytest.mark.timeout(240)
def test_qwen3_at_three_ranks_cuts_whole_heads_unevenly_and_each_rank_slices_its_own_weights():
    """DeepSpeed's ``TestQwen3UnevenTPPlan`` in small, and its ``test_tp_plan_basic_training`` semantics: 4
    key/value groups over 3 ranks are 2/1/1 (query rows 16/8/8, 4 query heads of width 4 per group, the output projection's input alike),
    2 over 3 are 1/1/0 (the third rank holds no attention and still computes: its all-reduce adds zeros); the MLP
    of 20 is 7/7/6. Each rank's slices are cut from the weights it holds (its own seed), what stays whole is the
    group's first rank's, and the group computes the model its slices gather into: logits and every gradient
    within the fp32 bound of that unsplit model (a reordered sum of at most 32 terms: 2 x 32 x 2^-24 relative to
    the largest magnitude, 4e-6)."""
    pytest.importorskip("transformers")
    ranks = run_ranks(_qwen3_on_three_ranks, 3, timeout=220)
    rows = {4: [(16, 8, 16, 7), (8, 4, 8, 7), (8, 4, 8, 6)], 2: [(16, 4, 16, 7), (16, 4, 16, 7), (0, 0, 0, 6)]}
    bound = 2 * 32 * 2.0 ** -24
    for kv in (4, 2):
        for rank, result in enumerate(ranks):
            assert result[kv]["rows"] == rows[kv][rank] and result[kv]["num_key_value_groups"] == 8 // kv
            assert result[kv]["own_slices"]
            assert result[kv]["logits"] <= bound * result[kv]["scale"]
            assert result[kv]["grads"] <= bound * result[kv]["scale"]
            for name, value in result[kv]["whole"].items():
                assert torch.equal(value, ranks[0][kv]["whole"][name]), name
        # the ranks drew different models: the first rank's copy is what made their whole weights equal
        assert len({result[kv]["own_embedding"] for result in ranks}) == 3
