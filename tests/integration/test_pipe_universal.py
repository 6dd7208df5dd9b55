"""Universal checkpoints across pipeline layouts (issue 29, item 4): a pipeline-parallel ZeRO-1 run (2 stages on
2 ranks) is converted to a universal checkpoint and loaded at 2 stages, at 1 stage x 2 data-parallel ranks,
at 1 stage on 1 rank, and into the dense model at ZeRO-3; a dense ZeRO-2 run's universal checkpoint loads
at 2 stages. Training continues with the uninterrupted run's losses.

Tolerance: every run computes the same operations on the same micro-batches; the masters and Adam moments
carry over exactly (the conversion copies them), so the runs differ only in the order of fp32 sums (the tied
embedding's gradient across stages, the data-parallel average, the ZeRO flat buffers): a few units of
2^-24 ~ 6e-8 relative in a gradient, which Adam passes on to an update of lr = 3e-3 times it. Over 3 steps
that stays far inside 1e-6 relative on the losses, the bound tests/integration/test_pipe.py derives and
uses for the same model.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.harness.launch import Launch, Runs
from tests.integration import _pipe_universal_workloads as u

pytestmark = pytest.mark.slow  # two launches (2 ranks, 1 rank)
TOL = 1e-6


def collect(launch: Runs) -> tuple[dict, dict, str]:
    """Two ranks save (pipeline and dense), then resume at other layouts; one rank resumes at one."""
    save_dir = str(launch.root)
    two = launch(Launch(u.two_ranks, 2, (save_dir,), timeout=400))
    one = launch(Launch(u.one_rank, 1, (save_dir,), timeout=300, rank=0))
    return two[0], one, save_dir


@pytest.mark.parametrize("layout", ["pp2", "pp1xdp2", "pp1", "dense_z3"])
def test_pipeline_checkpoint_resumes_at_another_layout(runs, layout: str) -> None:
    two, one, _ = runs
    resumed = {**two, **one}[layout]
    assert resumed["steps"] == u.FIRST
    np.testing.assert_allclose(resumed["more"], two["more"], rtol=TOL)
    gap = np.abs(np.array(resumed["more"]) / np.array(two["more"]) - 1).max()
    print(f"universal checkpoint pp=2 ZeRO-1 -> {layout}: largest relative loss gap {gap:.2e} over {u.MORE} steps")


def test_dense_checkpoint_resumes_as_a_pipeline(runs) -> None:
    two, _, _ = runs
    np.testing.assert_allclose(two["dense_first"], two["first"], rtol=TOL)  # the same run, dense or pipelined
    assert two["dense_to_pp2"]["steps"] == u.FIRST
    np.testing.assert_allclose(two["dense_to_pp2"]["more"], two["more"], rtol=TOL)


def test_universal_folder_names_parameters_by_layer(runs) -> None:
    _, _, save_dir = runs
    from pathlib import Path

    names = {p.name for p in (Path(save_dir) / "pp2_universal" / "zero").iterdir() if p.is_dir()}
    dense = {p.name for p in (Path(save_dir) / "dense_universal" / "zero").iterdir() if p.is_dir()}
    assert "0.weight" in names and not any(n.startswith("tied_modules.") for n in names)
    assert names == dense
