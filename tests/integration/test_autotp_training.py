"""AutoTP training (``tensor_parallel.autotp_size``): Hugging Face causal LMs split over 2 ranks, with ZeRO-1,
against the unsplit model trained in one process with torch's Adam and clipping.

The fp32 bound. The split changes no operation, only the order of sums: a row-parallel output is two partial
dot products (of length ``d/2``) added by the all-reduce, a column-parallel input gradient two partial sums, the
gradient norm two partial sums of squares. Reordering a fp32 sum of ``n`` terms moves it by at most ``2 γ_n`` of
the sum of the terms' magnitudes (``γ_n = n u / (1 - n u)``, ``u = 2^-24``); the longest sums cut in two are
Llama's LM-head input gradient's, over the vocabulary (``n = VOCAB = 97``: its Hugging Face plan cuts the head's
vocabulary, 49 and 48 rows, and gathers the logits), then the MLP down-projection's (``n = 64``), so a pass
differs from the reference by ``2 γ_97 ≈ 1.2e-5`` relative, at most. Adam's update divides by the root of the
second moment, so a relative gradient difference stays a relative update difference of the same order, and the
differences of successive steps add: over ``S`` steps the losses stay within ``S · 2 γ_97`` relative (20 steps:
2.3e-4). The measured difference is ~2e-7 (torch's Adam and dsrun's differ by a few ulps too).
"""
from __future__ import annotations

import pytest
import torch

from dsrun.checkpoint.tensor_parallel import shard_bounds
from tests.helpers import run_ranks
from tests.integration import _autotp_jobs as jobs
from tests.integration._inference_models import VOCAB

pytest.importorskip("transformers")

U = 2.0 ** -24
STEPS = 20


def fp32_bound(steps: int, n: int = VOCAB) -> float:
    gamma = n * U / (1 - n * U)
    return steps * 2 * gamma


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    """One 2-rank launch: both models' 20 steps, then GPT-2's checkpoint round trip (saved under ``"dir"``)."""
    save_dir = tmp_path_factory.mktemp("autotp_checkpoints")
    ranks = run_ranks(jobs.two_rank_job, 2, ["gpt2", "llama"], STEPS, str(save_dir), timeout=300)
    return [{**rank, "dir": save_dir} for rank in ranks]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_gpt2_tp2_zero1_matches_the_unsplit_run_and_holds_half_of_each_split_matrix(tp2_runs, name):
    ranks = [r[name] for r in tp2_runs]
    reference = torch.tensor(next(r["reference"] for r in ranks if r["reference"] is not None), dtype=torch.float64)
    for rank in ranks:
        losses = torch.tensor(rank["losses"], dtype=torch.float64)
        assert len(losses) == STEPS
        assert ((losses - reference).abs() / reference).max() <= fp32_bound(STEPS)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # both ranks of the group compute the same loss
    assert [r["tp_rank"] for r in ranks] == [0, 1] and [r["dp_rank"] for r in ranks] == [0, 0]
    assert [r["autotp_size"] for r in ranks] == [2, 2]
    assert torch.equal(ranks[0]["first_batch"], ranks[1]["first_batch"])  # one group reads one batch
    whole = ranks[0]["whole_bytes"]
    for rank in ranks:  # every linear of the blocks: the matrices (and column biases) halved, row biases whole
        held = rank["bytes"]
        assert set(held) == set(whole)
        for key, size in whole.items():
            row_bias = key.endswith(("c_proj.bias", "o_proj.bias", "down_proj.bias"))
            expected = size if row_bias else size // 2
            if key == "lm_head.weight":  # GPT-2's is tied to the embedding: whole; Llama's plan cuts its vocabulary
                expected = size if name == "gpt2" else size // VOCAB * shard_bounds(VOCAB, rank["tp_rank"], 2)[1]
            assert held[key] == expected, key


def test_partition_config_rules_split_llama_and_train_as_the_unsplit_run(tp2_runs):
    """``tensor_parallel.partition_config`` (``_autotp_jobs.LLAMA_RULES``): q/k/v column, o_proj row, gate/up column
    with gathered outputs, down_proj matched by nothing. The split reorders the same sums as the automatic one
    (row outputs and column input gradients in two partial sums; gathering reorders nothing), so the losses stay
    within the module docstring's bound of the unsplit run; each rank holds half of every matrix the rules cut,
    and the whole of down_proj and the LM head, which no rule names."""
    reference = torch.tensor(next(r["llama"]["reference"] for r in tp2_runs if r["llama"]["reference"]),
                             dtype=torch.float64)
    whole = tp2_runs[0]["llama"]["whole_bytes"]
    for rank in tp2_runs:
        rules = rank["rules"]
        losses = torch.tensor(rules["losses"], dtype=torch.float64)
        assert len(losses) == STEPS and ((losses - reference).abs() / reference).max() <= fp32_bound(STEPS)
        assert set(rules["bytes"]) == set(whole)
        for key, size in whole.items():
            kept_whole = ".down_proj." in key or key == "lm_head.weight"  # matched by no rule
            assert rules["bytes"][key] == (size if kept_whole else size // 2), key
    assert tp2_runs[0]["rules"]["losses"] == tp2_runs[1]["rules"]["losses"]


def test_a_fused_gqa_model_split_per_part_and_in_grains_trains_as_the_unsplit_run(tp2_runs):
    """``_autotp_jobs.GQA_TP``: a fused q|k|v of unequal parts (16, 8, 8: 4 query and 2 key/value heads of 4) cut
    per part on whole heads, the MLP's 48 features in grains of 32 (32 and 16). The longest sum the split
    reorders is the MLP input's gradient (gate's and up's 48 outputs each: 96 terms, under the docstring's
    ``n = 97``), so the losses stay within the module's bound of the unsplit run; each rank holds its widths (the
    bytes: q|k|v 16 of 32 rows, the MLP 32 or 16 of 48); the checkpoint's merge (``merge_checkpoint``,
    ``zero_to_fp32``) equals the weights all-gathered live, bit for bit."""
    ranks = [r["gqa"] for r in tp2_runs]
    reference = torch.tensor(ranks[0]["reference"], dtype=torch.float64)
    for rank, run in enumerate(ranks):
        losses = torch.tensor(run["losses"], dtype=torch.float64)
        assert len(losses) == STEPS and ((losses - reference).abs() / reference).max() <= fp32_bound(STEPS)
        shapes = run["shapes"]
        assert shapes["attn.qkv_proj.weight"] == (16, 16) and shapes["attn.o_proj.weight"] == (16, 8)
        assert shapes["mlp.gate_proj.weight"] == ((32, 16), (16, 16))[rank]
        assert shapes["mlp.down_proj.weight"] == ((16, 32), (16, 16))[rank]
        assert shapes["lm_head.weight"] == (VOCAB, 16)  # matched by no rule: whole
    assert ranks[0]["losses"] == ranks[1]["losses"]
    live, merged, fp32 = ranks[0]["live"], ranks[0]["merged"], ranks[0]["fp32"]
    assert merged["attn.qkv_proj.weight"].shape == (32, 16) and merged["mlp.down_proj.weight"].shape == (16, 48)
    assert live.keys() == merged.keys() and all(torch.equal(live[k], merged[k]) for k in live)
    assert all(torch.equal(fp32[k], merged[k]) for k in fp32)


def test_vocab_parallel_embedding_and_loss_train_as_the_unsplit_run_without_whole_logits(tp2_runs):
    """``tensor_parallel.vocab_parallel_lm_head``: Llama's embedding and untied head, and GPT-2's tied pair, cut by
    vocabulary (97 rows: 49 and 48); every rank's logits are its slice only, and the vocabulary-parallel
    cross-entropy (``vocab_parallel_ce_backend: torch``: the maximum and the sum of exponentials all-reduced, in
    torch's ops; ``liger`` is refused, tests/unit/tensor_parallel) trains within the module's bound of the
    unsplit run (the longest reordered sum is still the vocabulary's, now split 49 + 48)."""
    for name in ("llama", "gpt2"):
        reference = torch.tensor(next(r[name]["reference"] for r in tp2_runs if r[name]["reference"]),
                                 dtype=torch.float64)
        runs = [r["vocab"][name] for r in tp2_runs]
        for rank, run in enumerate(runs):
            rows = shard_bounds(VOCAB, rank, 2)[1]
            assert run["rows"] == (rows, rows) and run["logits"][-1] == rows
            assert run["tied"] == (name == "gpt2")  # a tied pair is cut once and stays tied
            losses = torch.tensor(run["losses"], dtype=torch.float64)
            steps = len(losses)
            assert ((losses - reference[:steps]).abs() / reference[:steps]).max() <= fp32_bound(steps), name
        assert runs[0]["losses"] == runs[1]["losses"]


def test_tp2_checkpoint_resumes_bit_exactly_and_loads_at_tp1(tp2_runs):
    ranks, tmp_path = [r["checkpoint"] for r in tp2_runs], tp2_runs[0]["dir"]
    for rank in ranks:
        assert rank["resumed"] == rank["tail"]  # bit-exact: the same losses after the load
        # the unsplit engine holds the merged weights exactly, and computes the split model's logits
        for key, value in ranks[0]["merged"].items():
            assert torch.equal(rank["loaded"][key], value), key
        torch.testing.assert_close(rank["whole_logits"], rank["logits"], rtol=fp32_bound(1), atol=1e-5)
    merged, fp32 = ranks[0]["merged"], ranks[0]["fp32"]  # zero_to_fp32 puts the masters' slices together too
    assert fp32.keys() == merged.keys() and all(torch.equal(fp32[k], merged[k]) for k in merged)
    assert sorted(p.name for p in (tmp_path / "step4").glob("*model_states.pt")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert sorted(p.name for p in (tmp_path / "step4").glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]


def test_tp2_checkpoint_converts_to_universal_and_resumes_at_tp1(tp2_runs):
    """DeepSpeed's universal layout of a TP=2 checkpoint: each split parameter whole (its slices concatenated along
    the split dimension, per fused part), its ``cat_dim`` and ``param_n_sub_params``; loaded at TP=1 x DP=2 with
    ``checkpoint.load_universal`` it resumes the TP=2 run. The loaded state is the saved one exactly, so the
    losses differ only by the order of fp32 sums (the split's, and DP=2's mean of two rows' means), the bound of
    the module docstring: ``S · 2 γ_64`` relative after ``S`` steps."""
    checkpoint = tp2_runs[0]["checkpoint"]
    universal, merged = checkpoint["universal"], checkpoint["merged"]
    splits = universal["splits"]
    assert splits["transformer.h.0.attn.c_attn.weight"][1] == 3  # GPT-2's fused q|k|v
    for name, entry in universal["fp32"].items():
        assert torch.equal(entry["param"], merged[name]), name  # fp32 training: the masters are the weights
        dim, parts = splits.get(name, (0, 1))
        assert entry["cat_dim"] == dim and entry.get("param_n_sub_params", 1) == parts, name
    assert set(merged) - set(universal["fp32"]) == {"lm_head.weight"}  # tied to the embedding: one master
    # DeepSpeed's entries in each TP rank's model states: the model's universal_checkpoint_info (GPT-2's Conv1D
    # weights, cut along a dimension DeepSpeed's converter would not concatenate along, published as sub-parameters
    # with their widths) and the recorded degrees, which DeepSpeedCheckpoint reads (pp 1, tp 2, dp 1)
    info = universal["uc_info"]
    assert r"^transformer\.h\.0\.ln_1\.weight$" in info["tp_replicated_parameter_patterns"]
    fused = {e["patterns"][0]: e for e in info["parameter_with_sub_params"]}
    assert fused[r"^transformer\.h\.0\.attn\.c_attn\.weight$"]["partition_dim"] == 1
    assert universal["degrees"] == [(1, 2, 1)]
    tail = torch.tensor(checkpoint["tail"], dtype=torch.float64)
    rows = torch.tensor([r["checkpoint"]["universal_tp1"] for r in tp2_runs], dtype=torch.float64)
    assert ((rows.mean(0) - tail).abs() / tail).max() <= fp32_bound(len(tail))


def test_tp2_by_dp2_on_4_ranks(tp2_runs):
    ranks = run_ranks(jobs.four_rank_job, 4, ["llama"], 2, 6, str(tp2_runs[0]["dir"]), timeout=300)
    # the TP=2 (data-parallel size 1) checkpoint's universal folder, loaded at TP=2 x DP=2: each data rank's row
    tail = torch.tensor(tp2_runs[0]["checkpoint"]["tail"], dtype=torch.float64)
    rows = torch.tensor([r["universal_tp2"] for r in ranks], dtype=torch.float64)
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[2], rows[3])  # a TP group computes one loss
    assert ((rows[[0, 2]].mean(0) - tail).abs() / tail).max() <= fp32_bound(len(tail))
    runs = [r["llama"] for r in ranks]
    assert [(r["dp_rank"], r["tp_rank"]) for r in runs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert torch.equal(runs[0]["first_batch"], runs[1]["first_batch"])
    assert torch.equal(runs[2]["first_batch"], runs[3]["first_batch"])
    assert not torch.equal(runs[0]["first_batch"], runs[2]["first_batch"])  # the data groups read different ones
    # DeepSpeed's getters (deepspeed.utils.groups, deepspeed.runtime.utils) read the same topology
    assert [r["deepspeed_groups"]["tp"] for r in runs] == [(2, 0, 0), (2, 1, 0), (2, 0, 2), (2, 1, 2)]
    assert [r["deepspeed_groups"]["dp"] for r in runs] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert all(r["deepspeed_groups"]["split"] and not r["deepspeed_groups"]["whole"] for r in runs)
    reference = torch.tensor(runs[0]["reference"], dtype=torch.float64)  # the global batch of both data ranks
    for group in ((0, 1), (2, 3)):  # a data rank's loss is its micro-batch's: their mean is the reference's
        assert runs[group[0]]["losses"] == runs[group[1]]["losses"]
    mean = (torch.tensor(runs[0]["losses"], dtype=torch.float64) + torch.tensor(runs[2]["losses"],
                                                                                  dtype=torch.float64)) / 2
    assert ((mean - reference).abs() / reference).max() <= fp32_bound(6)
    # AutoTP with ZeRO-3 over the data ranks (DeepSpeed's too): the same bound of the unsplit run, the unsplit
    # model's norm (the split parameters' squares summed over the TP group, the stage-3 shards over the data group),
    # each rank holding half of its TP slice of every split matrix (a quarter), a bit-exact resume
    zero3 = [r["zero3"] for r in ranks]
    reference = torch.tensor(zero3[0]["reference"], dtype=torch.float64)
    mean = (torch.tensor(zero3[0]["losses"], dtype=torch.float64) + torch.tensor(zero3[2]["losses"],
                                                                                   dtype=torch.float64)) / 2
    assert ((mean - reference).abs() / reference).max() <= fp32_bound(6)
    # its universal folder (each split parameter merged from the 2 x 2 ZeRO-3 files by range) loaded at TP=1 x DP=4
    # at ZeRO-3: the 4 rows' mean loss is the saved run's last 2 losses (the two data ranks' mean) within the bound
    saved_tail = (torch.tensor(zero3[0]["losses"][-2:], dtype=torch.float64) +
                  torch.tensor(zero3[2]["losses"][-2:], dtype=torch.float64)) / 2
    tp1_rows = torch.tensor([run["universal_tp1"] for run in zero3], dtype=torch.float64)
    assert ((tp1_rows.mean(0) - saved_tail).abs() / saved_tail).max() <= fp32_bound(2)
    for run in zero3:
        assert abs(run["norm"] - zero3[0]["reference_norm"]) <= fp32_bound(1) * zero3[0]["reference_norm"]
        assert run["resumed"] == run["losses"][-2:]
        assert run["shards"]["model.layers.0.self_attn.q_proj.weight"] == 32 * 32 * 4 // 4
        assert run["shards"]["model.layers.0.mlp.down_proj.weight"] == 32 * 64 * 4 // 4
        assert run["shards"]["model.norm.weight"] == 32 * 4 // 2  # whole over TP, halved by ZeRO-3


def test_a_given_tp_group_or_mpu_is_the_group_the_split_uses(tp2_runs):
    """``tensor_parallel.tp.tp_group`` and ``tensor_parallel.tp.mpu`` (its model-parallel group): every split layer
    and the feature communicate over the script's group object, and the run is the one whose group dsrun builds,
    bit for bit (the same ranks, the same sums in the same order)."""
    for rank in tp2_runs:
        for key in ("tp_group", "mpu"):
            run = rank["given_groups"][key]
            assert run["uses_it"], key
            assert run["losses"] == rank["gpt2"]["losses"][:4], key


def test_a_tp_group_other_than_the_topologys_is_refused(tp2_runs):
    for index, rank in enumerate(tp2_runs):
        said = rank["foreign_group"]
        assert f"tp_model_init(tp_group=...): this rank's group holds ranks [{index}], not its tensor-parallel group " \
            "[0, 1]" in said["tp_model_init"]
        assert f"tensor_parallel.tp.tp_group: this rank's group holds ranks [{index}], not its tensor-parallel group " \
            "[0, 1]" in said["tp_group"]
        assert f"tensor_parallel.tp.mpu: its data-parallel group holds ranks [0, 1], not this rank's data-parallel " \
            f"ranks [{index}]" in said["mpu"]
        assert all(message.count("\n") == 0 for message in said.values())  # one line each
        # the first forward checks that a group's ranks read one batch (DeepSpeed's check, on every rank)
        assert rank["inconsistent"].startswith("Data inconsistency within the TP group.")


def test_zero_stages_0_and_2_bf16_and_tp_overlap_comm_split_the_same_way(tp2_runs):
    reference = torch.tensor(next(r["gpt2"]["reference"] for r in tp2_runs if r["gpt2"]["reference"])[:4],
                             dtype=torch.float64)
    for rank in tp2_runs:
        for stage in (0, 2, "overlap"):  # "overlap": tensor_parallel.tp_overlap_comm, the same sums in another order
            losses = torch.tensor(rank["stages"][stage], dtype=torch.float64)
            assert ((losses - reference).abs() / reference).max() <= fp32_bound(4)
        # bf16 weights and activations (fp32 masters): within bf16's rounding of the fp32 run (u = 2^-8)
        bf16 = torch.tensor(rank["stages"]["bf16"], dtype=torch.float64)
        assert ((bf16 - reference).abs() / reference).max() <= 4 * 2.0 ** -8
    assert tp2_runs[0]["stages"] == tp2_runs[1]["stages"]


def test_injection_policy_tuple_names_the_row_parallel_linears_of_each_block(tp2_runs):
    """GPT-J with ``injection_policy_tuple: ["attn.out_proj", "mlp.fc_out"]``: those two are row-parallel in every
    block, the blocks' other linears column-parallel, the LM head whole (the model's own Hugging Face plan, which
    the tuple replaces, would cut it); each rank holds half of every split matrix. The losses stay within the fp32
    bound of the unsplit run; its longest reordered sum is fc_out's, over the MLP's 128 features."""
    reference = torch.tensor(tp2_runs[0]["policy"]["reference"], dtype=torch.float64)
    for rank in tp2_runs:
        run = rank["policy"]
        assert run["kinds"] == {"attn.q_proj": "column", "attn.k_proj": "column", "attn.v_proj": "column",
                                "attn.out_proj": "row", "mlp.fc_in": "column", "mlp.fc_out": "row", "lm_head": "whole"}
        for key, size in run["whole"].items():
            whole = key.startswith("lm_head.") or key == "mlp.fc_out.bias"  # a row bias is added once, whole
            assert run["held"][key] == (size if whole else size // 2), key
        losses = torch.tensor(run["losses"], dtype=torch.float64)
        assert ((losses - reference).abs() / reference).max() <= fp32_bound(4, 128)
