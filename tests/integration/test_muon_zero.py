"""Muon (``optimizer.type: Muon``) at ZeRO 0-3 on 2 gloo ranks against a single-process reference of the same
math (tests/integration/_muon_ranks.py), and its momentum through a checkpoint.

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


def test_momentum_is_saved_per_rank_and_resumes_exactly() -> None:
    for rank in results():
        res = rank["resume3"]
        assert res["files"] == [f"optimizer_rank_states_{i}.pt" for i in range(WORLD)]
        assert res["resumed"][0] == res["went_on"][0]
        np.testing.assert_array_equal(res["resumed"][1], res["went_on"][1])
