"""MoE checkpoints reshard between expert-parallel sizes: save with ep=2 on 2 ranks, load with ep=1 on 1 rank
(every expert on it) and save again, load that with ep=2: every expert's weights and Adam moments are
bit-identical to what was saved, and the next step's loss equals the uninterrupted run's (to fp32 rounding:
the one-rank run accumulates the two shards' gradients in another order)."""
from __future__ import annotations

import os

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
    tag_dir = tmp_path / "ckpt" / "a"
    assert sorted(p.name for p in tag_dir.glob("layer_0_expert_*_model_states.pt")) == \
        [f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(w.EXPERTS)]
    saved = {**first[0]["experts"], **first[1]["experts"]}
    assert len(saved) == 4 * w.EXPERTS  # 2 linears x (weight, bias) per expert

    one = run_ranks(w.ckpt_load_and_save, 1, root, "a", "b", timeout=300)[0]
    _same(one["experts"], saved)
    for name, value in one["shared"].items():
        np.testing.assert_array_equal(value, first[0]["shared"][name])
    scale = abs(first[0]["next_loss"])
    assert abs(one["next_loss"] - first[0]["next_loss"]) <= w.fp32_bound(2 * w.TOKENS, scale) * 64
    assert one["global_steps"] == 3

    back = run_ranks(w.ckpt_load_and_save, 2, root, "b", None, timeout=300)
    _same({**back[0]["experts"], **back[1]["experts"]}, saved)
    assert back[0]["next_loss"] == first[0]["next_loss"] or \
        abs(back[0]["next_loss"] - first[0]["next_loss"]) <= w.fp32_bound(2 * w.TOKENS, scale) * 64
    assert os.path.isfile(tmp_path / "ckpt" / "b" / "layer_0_expert_3_mp_rank_00_optim_states.pt")

    # ZeRO-2 with ep=2 on 2 ranks -> ZeRO-1 with ep=1 on 1 rank: the shared groups reshard through the
    # merged full state, the experts through their files
    z1 = run_ranks(w.ckpt_load_other_stage, 1, root, "z2", 1, timeout=300)[0]
    _same(z1["experts"], {**first[0]["z2_experts"], **first[1]["z2_experts"]})
    assert abs(z1["next_loss"] - first[0]["z2_next"]) <= w.fp32_bound(2 * w.TOKENS, scale) * 64


def test_zero_1_2_3_resume_with_the_saved_topology(tmp_path) -> None:
    results = run_ranks(w.resume_same_topology, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, result in enumerate(results):
        for stage, (uninterrupted, resumed) in result.items():
            assert resumed == uninterrupted, f"rank {rank} {stage}: {resumed} != {uninterrupted}"
    assert (tmp_path / "ckpt" / "s2" / "layer_0_expert_3_mp_rank_00_model_states.pt").is_file()
    assert not (tmp_path / "ckpt" / "s3" / "layer_0_expert_0_mp_rank_00_model_states.pt").exists()


def test_weights_only_loads_take_every_expert_and_keep_the_fresh_optimizer(tmp_path) -> None:
    for result in run_ranks(w.load_weights_only, 2, str(tmp_path / "ckpt"), timeout=300):
        for key, case in result.items():
            assert case["same_names"] and case["weights"] == 0.0 and case["masters"] == 0.0, (key, case)
            assert case["optimizer_state"] == 0, key
