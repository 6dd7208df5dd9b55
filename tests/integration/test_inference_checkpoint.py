"""Inference from training checkpoints: a ZeRO checkpoint of any stage saved by 2 ranks, and a bf16
``save_16bit_model`` file, load into a fresh model split over 2 ranks (TP=2) and give the logits of the
trained weights (the gathered fp32 masters; the 16-bit file's values)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.harness.checkpoints import CheckpointJob, run_jobs
from tests.harness.models import checkpoint_gpt
from tests.helpers import run_ranks
from tests.integration._inference_models import load_split

STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference_ckpt")
    # 3 steps: the log warm-up from 0 (DeepSpeed's WarmupLR) steps with lr 0 twice before the weights move
    jobs = [CheckpointJob(stage=s, precision="fp32", steps=3, global_batch=4, dropout=0.0, save_at=(3,),
                          save_dir=str(root / f"stage{s}")) for s in STAGES]
    jobs.append(CheckpointJob(stage=2, precision="bf16", steps=3, global_batch=4, dropout=0.0,
                              export16=str(root / "bf16")))
    results = run_ranks(run_jobs, 2, jobs, timeout=400)[0]
    sources = {f"stage{s}": str(root / f"stage{s}") for s in STAGES}
    sources["tag"] = str(root / "stage3" / "global_step3")  # one tag's folder
    sources["bf16_file"] = str(root / "bf16" / "pytorch_model.bin")
    sources["description"] = {"type": "ds_model", "version": 0.0, "checkpoints": "stage1", "base_dir": str(root)}
    params = {f"stage{s}": results[i]["params"] for i, s in enumerate(STAGES)}
    params.update(tag=params["stage3"], description=params["stage1"],
                  bf16_file=results[-1]["params"])  # the bf16 module's values, as floats
    loaded = run_ranks(load_split, 2, sources, timeout=300)
    return params, loaded


@pytest.mark.slow
@pytest.mark.parametrize("source", [f"stage{s}" for s in STAGES] + ["tag", "bf16_file", "description"])
def test_a_training_checkpoint_loads_resharded_to_tp2(trained, source):
    params, loaded = trained
    model = checkpoint_gpt(0.0).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params[source].items()})
    fresh = checkpoint_gpt(0.0).eval()
    ids = torch.from_numpy(loaded[0]["ids"])
    with torch.no_grad():
        want, untrained = model(ids).numpy(), fresh(ids).numpy()
    # fp32, 2 blocks (5 sequential sums), longest sum 128 (the MLP's down-projection)
    bound = 2 * 5 * 128 * np.finfo(np.float32).eps / 2 * max(1.0, np.abs(want).max())
    for rank in loaded:
        assert np.abs(rank[source] - want).max() <= bound
    assert np.abs(want - untrained).max() > 100 * bound  # the trained weights, not the initial ones
