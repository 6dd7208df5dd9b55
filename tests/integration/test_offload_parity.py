"""Optimizer offload (CPU at stages 1-3, NVMe at stage 3) over 2 gloo ranks tracks the in-memory runs.

fp32: losses track single-process PyTorch at each step within the bound derived from the arithmetic
(tests/tolerance.py: ``(K + 1) x`` the spread of valid fp32 orderings of the reference around
its float64 run; the in-memory stages meet the same bound in test_engine_parity / test_zero3_parity), and
offloaded runs equal the in-memory run of their stage exactly (the same CPU Adam kernel on the same numbers).
bf16: stage-3 NVMe and stage-2 CPU offload against in-memory bf16 ZeRO-3, within the bound between two runs
that round differently (``2 K x`` the spread of PyTorch's own bf16 runs; observed: identical, the fused 16-bit
write rounds like the in-memory copy). Resident memory: NVMe offload's RSS is below the in-memory run's by at
least the bytes of the offloaded fp32 masters and Adam states.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.harness.launch import Launch
from tests.helpers import run_ranks
from tests.integration import _offload_workloads as o
from tests import tolerance as t
from tests.harness.models import loss_terms
from tests.harness.runs import reference_run

FP32_CASES = ["cpu/1", "cpu/2", "cpu/3", "nvme/3", "nvme_fast/3", "ratio/3"]
BF16_CASES = ["base_bf16/3", "nvme_bf16/3", "cpu_bf16/2"]
GAS_CASES = ["nvme_gas/3"]


def launches(root) -> dict:
    cases = ["base/3"] + FP32_CASES + BF16_CASES + GAS_CASES
    return {"parity": Launch(o.parity_suite, 2, (str(root), cases), timeout=600, rank=0)}


@pytest.fixture(scope="module")
def suite(runs) -> dict:
    return runs["parity"]


@functools.lru_cache(maxsize=None)
def spread(global_size: int, clip: float = 0.0, dtype: torch.dtype = torch.float32) -> t.Spread:
    def run(d: torch.dtype, parts: int, reverse: bool) -> dict:
        return reference_run("gpt", o.STEPS, global_size, clip, d, parts, reverse)
    return t.spread(run, dtype, loss_terms("gpt", global_size))


def test_fp32_cpu_and_nvme_offload_track_pytorch_and_in_memory(suite):
    s = spread(4)
    for key in ["base/3"] + FP32_CASES:
        t.assert_tracks(suite[key], s.reference, s, key, what=("losses",))
    for key in ("cpu/3", "nvme/3", "nvme_fast/3", "ratio/3"):
        assert suite[key]["losses"] == suite["base/3"]["losses"], key
        np.testing.assert_array_equal(suite[key]["params"], suite["base/3"]["params"])


def test_gradient_accumulation_and_clipping_with_nvme(suite):
    s = spread(8, 0.05)
    t.assert_tracks(suite["nvme_gas/3"], s.reference, s, "nvme_gas/3", what=("losses", "norms"))


def test_bf16_offload_tracks_in_memory_bf16(suite):
    s = spread(4, dtype=torch.bfloat16)
    for key in ("nvme_bf16/3", "cpu_bf16/2"):
        t.assert_tracks(suite[key], suite["base_bf16/3"], s, key, against="run", what=("losses",))


@pytest.mark.slow
def test_nvme_offload_lowers_resident_memory_by_the_offloaded_states(tmp_path):
    in_memory = run_ranks(o.resident_memory, 2, None, timeout=300)
    nvme = run_ranks(o.resident_memory, 2, str(tmp_path), timeout=300)
    for rank, (mem, off) in enumerate(zip(in_memory, nvme)):
        offloaded = 12 * off["trainable"]  # fp32 master + exp_avg + exp_avg_sq per trainable element
        assert off["swapped_bytes"] == offloaded
        saved = mem["rss"] - off["rss"]
        assert saved >= offloaded, (f"rank {rank}: RSS {mem['rss'] / 2**20:.0f} MiB in memory vs "
                                    f"{off['rss'] / 2**20:.0f} MiB with NVMe: saved {saved / 2**20:.0f} MiB, "
                                    f"offloaded {offloaded / 2**20:.0f} MiB")
        # the same fp32 Adam kernel on the same gradients, bf16 written round-to-nearest-even in both: the
        # offload moves where the states live, not the arithmetic
        assert off["losses"] == mem["losses"], (off["losses"], mem["losses"])
