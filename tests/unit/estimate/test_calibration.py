"""The estimate against a real PyTorch training step, measured through the --measured hook.

A subprocess runs plain AdamW steps (fp32, one rank: what ZeRO stage 0 holds) on the test GPT and records
its peak with ``write_rank_peak``; the estimator reads it back with ``load_measured_peaks`` and must be
within 15%. glibc is told to return large blocks at once, so peak RSS tracks tensor memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsrun.estimate import EstimateInputs, GPTShape, count_parameters, estimate_peak_bytes_per_rank
from dsrun.estimate.counting import meta_device
from dsrun.estimate.measure import compare_peaks, load_measured_peaks
from tests.helpers import REPO
from tests.unit.estimate.tiny_gpt import TinyGPT

CASE = {"vocab_size": 8192, "block_size": 256, "n_layer": 4, "n_head": 8, "n_embd": 512,
        "micro_batch": 4, "seq_len": 256}


@pytest.mark.slow
def test_stage0_one_rank_prediction_is_within_15_percent_of_a_real_step(tmp_path):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    subprocess.run([sys.executable, "-m", "tests.unit.estimate.calibration_worker", json.dumps(CASE),
                    str(tmp_path)], env=env, cwd=REPO, check=True, timeout=240)
    model_args = {k: v for k, v in CASE.items() if k not in ("micro_batch", "seq_len")}
    with meta_device():
        counts = count_parameters(TinyGPT(**model_args))
    spec = EstimateInputs(total_params=counts.total, largest_layer_params=counts.largest_layer, optimizer="AdamW",
                          precision="fp32", micro_batch_size=CASE["micro_batch"], seq_len=CASE["seq_len"],
                          model_shape=GPTShape(CASE["n_layer"], CASE["n_embd"], CASE["n_head"], CASE["vocab_size"]))
    rows = compare_peaks(estimate_peak_bytes_per_rank(spec).peak_per_rank, load_measured_peaks(tmp_path),
                         case="stage0-1rank-fp32")
    print("\n" + "\n".join(json.dumps(row.to_dict()) for row in rows))
    assert rows[0].within(15), rows[0].to_dict()
