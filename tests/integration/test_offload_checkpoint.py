"""Checkpoints of optimizer-offloaded runs: the same DeepSpeed layout as in-memory runs, loadable both ways,
resharded across stages, consolidated by zero_to_fp32; and a run SIGKILLed in the middle of an NVMe swap
resumes from its last checkpoint on the same loss curve."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from dsrun.checkpoint.safe_load import load_file
from dsrun.offload.swap_store import SWAP_ROOT_NAME
from dsrun.utils import zero_to_fp32 as z2f
from tests import tolerance as t
from tests.harness.checkpoints import CheckpointJob, checkpoint_reference, run_jobs
from tests.harness.models import SEQ
from tests.helpers import run_ranks


def nvme_zero(nvme_path: str, **extra: Any) -> dict[str, Any]:
    return {"sub_group_size": 2000,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 12, **extra}}


def checkpoint_jobs(root: str, nvme_path: str) -> list[CheckpointJob]:
    """Save with NVMe offload / in memory; load each into the other, into stage-2 CPU offload (resharded)."""
    base = CheckpointJob(stage=3, precision="fp32", steps=2, global_batch=4, dropout=0.0)
    nvme = base.but(zero=nvme_zero(nvme_path))
    a, b = f"{root}/nvme", f"{root}/mem"
    return [
        nvme.but(save_at=(2,), save_dir=a),                                 # 0: NVMe run saved at step 2
        base.but(steps=4, save_at=(2,), save_dir=b),                        # 1: in-memory reference, 4 steps
        base.but(load=a),                                                   # 2: NVMe -> in memory
        nvme.but(load=b),                                                   # 3: in memory -> NVMe
        nvme.but(load=a),                                                   # 4: NVMe -> NVMe
        base.but(stage=2, load=a,                                           # 5: NVMe stage 3 -> CPU stage 2
                 zero={"offload_optimizer": {"device": "cpu"}}),
        base.but(stage=1, save_at=(2,), save_dir=f"{root}/cpu1",            # 6: CPU stage 1 saved at 2
                 zero={"offload_optimizer": {"device": "cpu"}}),
        base.but(stage=1, load=f"{root}/cpu1"),                             # 7: CPU stage 1 -> in memory
    ]


@functools.lru_cache(maxsize=None)
def spread() -> t.Spread:
    """Two runs of these jobs that reduce or step in another order differ by rounding: the bound between them is
    derived from the arithmetic (tests/tolerance.py), for the jobs' 4 steps of batch 4."""
    return t.spread(lambda d, parts, reverse: checkpoint_reference(4, 4, d, parts, reverse), torch.float32, 4 * SEQ)


def assert_same_curve(losses: list[float], reference: list[float], label: str) -> None:
    t.assert_tracks({"losses": losses}, {"losses": reference}, spread(), label, against="run", what=("losses",))


@pytest.mark.slow
def test_offloaded_and_in_memory_checkpoints_load_into_each_other(tmp_path):
    root, nvme = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    out = run_ranks(run_jobs, 2, checkpoint_jobs(root, nvme), timeout=400)[0]
    reference = out[1]["losses"]
    for job in (2, 3, 4, 5):
        assert out[job]["loaded_steps"] == 2
        assert_same_curve(out[job]["losses"], reference[2:], f"job {job}")
    # NVMe -> NVMe and in memory <-> NVMe at the same stage: the same arithmetic, exactly
    assert out[3]["losses"] == out[4]["losses"] == out[2]["losses"]
    assert_same_curve(out[0]["losses"], reference[:2], "job 0")
    # the saved files have the in-memory layout: fp32 groups and Adam moments for every sub-group
    optim = load_file(tmp_path / "ckpt/nvme/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    osd = optim["optimizer_state_dict"]
    assert len(osd["fp32_flat_groups"]) == len(osd["optimizer_state_dict"]["state"]) > 1
    assert all(s["step"] == 2 and s["exp_avg"].abs().sum() > 0 for s in osd["optimizer_state_dict"]["state"].values())
    # zero_to_fp32 consolidates the NVMe run's masters into the model it had at step 2
    full = z2f.get_fp32_state_dict_from_zero_checkpoint(f"{root}/nvme", "global_step2")
    for name, value in out[0]["params"].items():
        np.testing.assert_array_equal(full[name].numpy(), value, err_msg=name)
    # CPU offload at stage 1 saved, loaded in memory: continues like the stage-3 reference
    assert_same_curve(out[7]["losses"], reference[2:], "job 7")
    assert not any((tmp_path / "nvme" / SWAP_ROOT_NAME).iterdir())  # every rank's swap folder was removed


@pytest.mark.slow
def test_killed_during_an_nvme_swap_resumes_on_the_same_curve(tmp_path):
    root, nvme = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    job = CheckpointJob(stage=3, precision="fp32", steps=5, global_batch=4, dropout=0.0, zero=nvme_zero(nvme),
                        save_dir=root)
    # save at step 2, then die in step 4, after the 3rd swap write (files mid-update)
    with pytest.raises(AssertionError, match="exit"):
        run_ranks(run_jobs, 2, [job.but(save_at=(2,), kill_on_swap_write=(4, 3))], timeout=300)
    left = list((tmp_path / "nvme" / SWAP_ROOT_NAME).iterdir())
    assert left  # the killed ranks' swap files are still there
    # one launch: the uninterrupted run, then the resumed one
    whole, resumed = run_ranks(run_jobs, 2, [job.but(save_dir=str(tmp_path / "whole"), save_at=()),
                                             job.but(steps=3, load=root, save_at=())], timeout=300)[0]
    assert resumed["loaded_steps"] == 2
    assert resumed["losses"] == whole["losses"][2:]
    for name, value in whole["params"].items():
        np.testing.assert_array_equal(resumed["params"][name], value, err_msg=name)
    # the new run removed the dead processes' folders and its own
    assert not any((tmp_path / "nvme" / SWAP_ROOT_NAME).iterdir())
