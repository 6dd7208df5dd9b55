"""Muon (``optimizer.type: Muon``) at ZeRO 0-3 on 2 gloo ranks against a single-process reference of the same
math (tests/integration/_muon_ranks.py), ZeRO-3 with NVMe optimizer offload against ZeRO-3 in memory, and its
momentum through a checkpoint.

Bound derived from the arithmetic (tests/tolerance.py): the reference's fp32 runs in valid orderings (the
whole batch, one sample at a time, both orders) spread around its float64 run; every step's loss and
clipping norm and the final parameters of each stage within ``(K + 1)`` times that spread (measured: 0.05-0.15x
the bound; without the clip measured over the updates, 700x to 2e5x). Newton-Schulz runs
in fp32 in both (DeepSpeed's CPU default is bf16/fp16: docs/muon.md), so the spread measures the iteration's
own amplification of rounding. A stage that orthogonalised a partition instead of the whole matrix, or
clipped by the gradients' norm instead of the updates', lands orders of magnitude outside it.
"""
from __future__ import annotations

import functools
import tempfile

import numpy as np
import pytest
import torch

from tests import tolerance as t
from tests.helpers import run_ranks
from tests.integration import _muon_ranks as r

WORLD = 2


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_ranks(r.stages_and_resume, WORLD, tempfile.mkdtemp(prefix="dsrun-muon-"), timeout=300)


@functools.lru_cache(maxsize=None)
def spread(ns_method: str) -> t.Spread:
    def run(dtype: torch.dtype, parts: int, reverse: bool) -> dict:
        return r.reference(dtype, parts, reverse, ns_method, WORLD)
    return t.spread(run, torch.float32, r.MICRO * WORLD)


@pytest.mark.parametrize("stage,ns_method", [(0, "gram"), (1, "standard"), (2, "gram"), (3, "standard")])
def test_zero_stage_matches_the_single_process_reference(stage: int, ns_method: str) -> None:
    ranks = [res[f"stage{stage}"] for res in results()]
    got = {"losses": [float(np.mean(step)) for step in zip(*(rank["losses"] for rank in ranks))],
           "norms": ranks[0]["norms"], "params": ranks[0]["params"]}
    s = spread(ns_method)
    assert min(s.reference["norms"]) > r.CLIP  # the clip is active at every step: its norm is checked too
    t.assert_tracks(got, s.reference, s, f"ZeRO-{stage} {ns_method}", what=("losses", "norms", "params"))
    np.testing.assert_array_equal(ranks[1]["params"], ranks[0]["params"])  # every rank holds the same model
    # DeepSpeed's split: the two hidden matrices get Muon, the rest (embed, lm_head, biases, norm) Adam
    assert ranks[0]["groups"] == [("muon-params", 1), ("adam-params", 1)]
    # the two matrices are computed once each, round-robin: each rank keeps one matrix's momentum
    assert sorted(rank["owned"][0] for rank in ranks) == sorted(r.MUON_NAMES)
    assert all(len(rank["owned"]) == 1 for rank in ranks)


def test_nvme_offload_trains_bit_exactly_like_memory_and_the_key_keeps_momentum_in_memory() -> None:
    """ZeRO-3 with the optimizer in NVMe swap files (ZeRO-Infinity) computes what ZeRO-3 in memory does, in the
    same order (the updates from the same whole gradients, applied tile by tile with the same operations):
    every loss, norm and parameter bit-exact. ``save_muon_momentum_buffer_in_memory`` moves the momentum of the
    matrix each rank computes out of the swap files into memory, byte for byte, and changes nothing else."""
    for rank, res in enumerate(results()):
        memory = res["stage3"]
        owned = {"h1.weight": 12 * 8, "h2.weight": 12 * 12}[memory["owned"][0]] * 4  # fp32 bytes of its matrix
        swapped, kept = res["nvme_in_memory=False"], res["nvme_in_memory=True"]
        for run in (swapped, kept):
            assert run["losses"] == memory["losses"] and run["norms"] == memory["norms"]
            np.testing.assert_array_equal(run["params"], memory["params"])
        # sub-group 0 is Muon's (its master only: no Adam moments; its gradient file is let go at zero_grad),
        # sub-group 1 Adam's; off, the momentum of this rank's matrix is a file beside them
        assert kept["bytes"]["keys"] == ["exp_avg.1", "exp_avg_sq.1", "master.0", "master.1"], rank
        assert swapped["bytes"]["keys"] == sorted(kept["bytes"]["keys"] + [f"muon_momentum.{memory['owned'][0]}"])
        assert swapped["bytes"]["momentum_files"] == owned and swapped["bytes"]["momentum_memory"] == 0
        assert kept["bytes"]["momentum_files"] == 0 and kept["bytes"]["momentum_memory"] == owned
        assert swapped["bytes"]["files"] - kept["bytes"]["files"] == owned


def test_momentum_is_saved_per_rank_and_resumes_exactly() -> None:
    """Saved by the NVMe run with the momentum swapped (read from the files), resumed in memory and into swap
    files: both go on bit-exactly like the run that was saved."""
    for rank in results():
        res = rank["resume"]
        assert res["files"] == [f"optimizer_rank_states_{i}.pt" for i in range(WORLD)]
        for placement in ("memory", "nvme"):
            assert res[placement][0] == res["went_on"][0], placement
            np.testing.assert_array_equal(res[placement][1], res["went_on"][1])
