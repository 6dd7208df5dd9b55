"""ZeRO-Infinity parameter offload (``offload_param`` cpu | nvme, stage 3) over 2 gloo ranks.

Parity: every offloaded run (parameters to CPU or NVMe, alone or with the optimizer offloaded to CPU or
NVMe) tracks the same run without offload within the bound between two runs derived from the arithmetic
(tests/tolerance.py: ``2 K x`` the spread of valid orderings of the PyTorch reference around
its wider-precision run, for fp32 and for bf16; parameter offload alone gives identical numbers, the CPU
optimizer and the fused 16-bit write-back of optimizer offload differ in rounding only). Also: a model built
under ``zero.Init`` with NVMe offload trains like one built whole; a checkpoint of an NVMe-offloaded run
resumes exactly, offloaded or not; the swap files are gone afterwards; and with NVMe offload a rank's RSS is
lower by the shards it no longer holds.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.harness.launch import Launch
from tests.harness.models import loss_terms
from tests.harness.runs import reference_run
from tests.helpers import run_ranks
from tests.integration import _offload_param_workloads as w
from tests import tolerance as t


@functools.lru_cache(maxsize=None)
def spread(dtype: torch.dtype = torch.float32) -> t.Spread:
    def run(d: torch.dtype, parts: int, reverse: bool) -> dict:
        return reference_run("nanogpt", w.STEPS, 4, 0.0, d, parts, reverse)
    return t.spread(run, dtype, loss_terms("nanogpt", 4))


def launches(root) -> dict:
    return {"suite": Launch(w.offload_suite, 2, (f"{root}/nvme", f"{root}/ckpt"), timeout=300)}


@pytest.fixture(scope="module")
def results(runs) -> list[dict]:
    return runs["suite"]


@pytest.mark.parametrize("case", ["cpu", "nvme", "nvme_cached", "nvme_init", "both_cpu", "opt_cpu_param_nvme",
                                  "both_nvme"])
def test_fp32_offloaded_runs_track_the_in_memory_run(results: list[dict], case: str) -> None:
    ref, got = results[0]["ref"], results[0][case]
    # final parameters too: Adam turns rounding noise of near-zero gradients into visible parameter noise, in
    # PyTorch's own orderings as in dsrun's, which the spread measures
    t.assert_tracks(got, ref, spread(), case, against="run")
    np.testing.assert_array_equal(results[1][case]["params"], got["params"])  # both ranks gather the same


@pytest.mark.parametrize("case", ["bf16_nvme", "both_nvme_bf16"])
def test_bf16_nvme_tracks_bf16_in_memory(results: list[dict], case: str) -> None:
    ref, got = results[0]["bf16_ref"], results[0][case]
    t.assert_tracks(got, ref, spread(torch.bfloat16), case, against="run", what=("losses",))


def test_nvme_shards_leave_memory_and_are_read_ahead(results: list[dict]) -> None:
    for rank_result in results:
        nvme, ref = rank_result["nvme"], rank_result["ref"]
        assert nvme["device"] == "nvme"
        assert nvme["memory"]["parameters"] < ref["memory"]["parameters"]  # only persistent ones stay
        stats = nvme["stats"]
        assert stats["swapped_params"] > 0 and stats["cached_numel"] == 0  # max_in_cpu=0: nothing cached
        assert stats["buffers"] <= 3  # never more than buffer_count buffers
        assert stats["read_ahead_hits"] > 0  # the recorded order let reads start before their use
        assert stats["read_bytes"] > 0 and stats["written_bytes"] > 0
        cached = rank_result["nvme_cached"]["stats"]
        assert cached["cached_numel"] > 0 and cached["read_bytes"] < stats["read_bytes"]


def test_checkpoint_of_an_nvme_offloaded_run_resumes_exactly(results: list[dict]) -> None:
    # the exact fp32 masters and Adam moments come back, and offloaded fp32 steps equal in-memory ones exactly
    # (test_offload_parity): the continued curve is the same numbers
    ckpt = results[0]["ckpt"]
    assert ckpt["loaded_nvme"] == ckpt["continued"] and ckpt["loaded_plain"] == ckpt["continued"]


def test_swap_files_are_removed_when_the_store_closes(results: list[dict]) -> None:
    for rank_result in results:
        assert rank_result["leftover"] == []


ALLOCATOR_SLACK = 16 * 2**20  # heap pages glibc keeps after malloc_trim differ by this much between runs


@pytest.mark.slow
def test_nvme_offload_lowers_resident_memory_by_the_offloaded_state(tmp_path) -> None:
    """Per-rank RSS (psutil) after two steps of a 50M-parameter bf16 GPT built under zero.Init, against the
    same run in memory (both runs load the async I/O library, see ``rss_run``):

    * NVMe parameters: lower by the bf16 shards now in files, less the read pool that replaces them and an
      allocator slack of 16 MiB (measured: 34-46 MiB saved of 48 MiB of shards, pool 4.6 MiB);
    * NVMe parameters and optimizer (ZeRO-Infinity): lower by at least the shards plus the swapped fp32
      masters and Adam states, less both pools.
    """
    nvme = str(tmp_path)
    params = {"offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "buffer_size": 600_000,
                                "max_in_cpu": 0}}
    both = {**params, "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4}}
    in_memory = run_ranks(w.rss_run, 2, None, nvme, timeout=240)
    param_only = run_ranks(w.rss_run, 2, params, nvme, timeout=240)
    infinity = run_ranks(w.rss_run, 2, both, nvme, timeout=240)
    for mem, off, inf in zip(in_memory, param_only, infinity):
        assert off["offloaded"] > 40 * 2**20  # about 48 MiB of bf16 shards per rank
        saved = mem["rss"] - off["rss"]
        assert saved >= off["offloaded"] - off["pool"] - ALLOCATOR_SLACK, (saved, off["offloaded"], off["pool"])
        offloaded = inf["offloaded"] + inf["optimizer_swapped"]
        assert inf["optimizer_swapped"] > 200 * 2**20  # fp32 masters + two moments: 12 B per element
        saved = mem["rss"] - inf["rss"]
        assert saved >= offloaded - inf["pool"] - inf["optimizer_pool"], (saved, offloaded)
        # where the shards and states live does not change the arithmetic: the same bf16 values read back, the
        # same fp32 Adam kernel, bf16 written round-to-nearest-even in both
        assert off["losses"] == mem["losses"], (off["losses"], mem["losses"])
        assert inf["losses"] == mem["losses"], (inf["losses"], mem["losses"])
