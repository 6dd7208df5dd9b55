"""MoE checkpoints reshard between expert-parallel sizes and ZeRO stages: save with ep=2 on 2 ranks (ZeRO 0, 2
and 3), load with ep=1 on 1 rank (every expert on it) and save again, load that with ep=2; stage 3 loads into
stage 2 and stage 2 into stage 3: every expert's weights and Adam moments are bit-identical to what was saved,
and the next step's loss equals the uninterrupted run's (to fp32 rounding: the one-rank run accumulates the
two shards' gradients in another order)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import run_ranks
from tests.integration import _moe_workloads as w

# multi-process launches (tens of seconds each on a loaded 2-core machine): slow, as the engine parity tests
pytestmark = pytest.mark.slow


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        for key in a[name]:
            np.testing.assert_array_equal(a[name][key], b[name][key], err_msg=f"{name} {key}")


def test_save_ep2_load_ep1_and_back(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    first = run_ranks(w.ckpt_save_first, 2, root, timeout=300)
    for tag in ("a", "z3"):  # one file per expert at every stage, ZeRO-3 included
        assert sorted(p.name for p in (tmp_path / "ckpt" / tag).glob("layer_0_expert_*_model_states.pt")) == \
            [f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(w.EXPERTS)]
    saved = {tag: {**first[0][tag]["experts"], **first[1][tag]["experts"]} for tag in ("a", "z2", "z3")}
    assert all(len(experts) == 4 * w.EXPERTS for experts in saved.values())  # 2 linears x (weight, bias)
    scale = abs(first[0]["a"]["next_loss"])
    bound = w.fp32_bound(2 * w.TOKENS, scale) * 64

    def check(result: dict, key: str, source: str) -> None:
        _same(result[key]["experts"], saved[source])
        assert abs(result[key]["next_loss"] - first[0][source]["next_loss"]) <= bound, key
        assert result[key]["global_steps"] == 3, key

    # one rank, ep=1: from stage 0, 2 and 3 into the same stage, stage 3 -> 2 and stage 2 -> 3
    one = run_ranks(w.ckpt_load, 1, root, [("a", 0, "b"), ("z2", 1, None), ("z3", 3, "z3one"), ("z3", 2, None),
                                           ("z2", 3, None)], timeout=300)[0]
    for key, source in (("a->zero0", "a"), ("z2->zero1", "z2"), ("z3->zero3", "z3"), ("z3->zero2", "z3"),
                        ("z2->zero3", "z2")):
        check(one, key, source)
    for key, source in (("a->zero0", "a"), ("z3->zero2", "z3"), ("z2->zero3", "z2")):  # the shared weights too
        for name, value in one[key]["shared"].items():
            np.testing.assert_array_equal(value, first[0][source]["shared"][name], err_msg=f"{key} {name}")
    assert (tmp_path / "ckpt" / "b" / "layer_0_expert_3_mp_rank_00_optim_states.pt").is_file()

    # back to ep=2 on two ranks: stage 0 and stage 3 saved by one rank, and stage 0 into stage 3
    back = run_ranks(w.ckpt_load, 2, root, [("b", 0, None), ("z3one", 3, None), ("b", 3, None)], timeout=300)
    merged = {key: {"experts": {**back[0][key]["experts"], **back[1][key]["experts"]},
                    "next_loss": back[0][key]["next_loss"], "global_steps": back[0][key]["global_steps"]}
              for key in back[0]}
    for key, source in (("b->zero0", "a"), ("z3one->zero3", "z3"), ("b->zero3", "a")):
        check(merged, key, source)


def test_zero_1_2_3_resume_with_the_saved_topology(tmp_path) -> None:
    results = run_ranks(w.resume_same_topology, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, result in enumerate(results):
        for stage, (uninterrupted, resumed) in ((k, v) for k, v in result.items() if not k.endswith("/routed")):
            assert resumed == uninterrupted, f"rank {rank} {stage}: {resumed} != {uninterrupted}"
        # each rank reads its own files back, unless the expert groups were laid out otherwise when saved
        assert [result[f"s{s}/routed"] for s in (1, 2, 3)] == [0, 0, 0] and result["s2/data_first/routed"] == 1
    for stage in (2, 3):
        assert (tmp_path / "ckpt" / f"s{stage}" / "layer_0_expert_3_mp_rank_00_model_states.pt").is_file()


def test_weights_only_loads_take_every_expert_and_keep_the_fresh_optimizer(tmp_path) -> None:
    results = run_ranks(w.load_weights_only, 2, str(tmp_path / "ckpt"), timeout=300)
    assert {key.split("/")[0] for key in results[0]} == {"zero0", "zero2", "zero3"}
    for result in results:
        for key, case in result.items():
            assert case["same_names"] and case["weights"] == 0.0 and case["masters"] == 0.0, (key, case)
            assert case["optimizer_state"] == 0, key


def test_pipeline_with_moe_saves_and_loads_at_its_layout_and_refuses_the_rest(tmp_path) -> None:
    results = run_ranks(w.pipe_moe_checkpoints, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, result in enumerate(results):
        # ep=2: each rank's own experts (weights, fp32 masters, Adam moments) back bit for bit, the same next loss
        _same(result["loaded"], result["saved"])
        assert result["loaded_next"] == result["next"], rank
        for key in ("weights_only", "zero2"):
            assert result[key].startswith("UserError: load_checkpoint(load_dir=...): a pipeline checkpoint of MoE "
                                          "layers with expert parallelism"), (key, result[key])
        assert "needs ZeRO stage 1 or 2" in result["save_zero0"]
        # ep=1 across stage counts: 2 stages x 1 rank -> 1 stage x 2 ranks, every parameter as saved
        saved = {**results[0]["ep1_saved"], **results[1]["ep1_saved"]}
        assert set(result["ep1_loaded"]) == set(saved)
        for name, value in result["ep1_loaded"].items():
            np.testing.assert_array_equal(value, saved[name], err_msg=name)
    assert any(".deepspeed_experts.1." in name for name in results[0]["loaded"])
    assert not (tmp_path / "ckpt" / "ep2z0").exists()


def test_optimizer_and_parameter_offload_to_host_memory_are_exact_with_moe(tmp_path) -> None:
    results = run_ranks(w.offload_moe, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, result in enumerate(results):
        for offloaded, in_memory in (("z1/cpu", "z1"), ("z2/cpu", "z2"), ("z3/cpu", "z3"), ("z3/cpu+param", "z3")):
            assert result[offloaded]["losses"] == result[in_memory]["losses"], (rank, offloaded)
            _same(result[offloaded]["experts"], result[in_memory]["experts"])
            for name, value in result[offloaded]["params"].items():
                np.testing.assert_array_equal(value, result[in_memory]["params"][name], err_msg=f"{offloaded} {name}")
        # checkpoints: the offloaded run's expert files load into memory, and the other way round
        _same(result["off3->z2"]["experts"], result["z3/cpu"]["experts"])
        _same(result["mem3->z2/cpu"]["experts"], result["z3"]["experts"])
