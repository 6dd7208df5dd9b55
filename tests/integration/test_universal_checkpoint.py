"""Universal checkpoints (DeepSpeed's "Universal Checkpointing" tutorial): a checkpoint saved by 2 ranks at ZeRO-2
is converted with ``dsrun convert ds-to-universal`` and loaded at 1 rank ZeRO-3 and at 3 ranks ZeRO-1
(``checkpoint.load_universal``); training continues with the losses of an uninterrupted run at the new
layout (same global batch of 6, fp32, no dropout).

The uninterrupted runs at 1 and 3 ranks sum their gradients over other rank counts than the 2-rank run that
saved, so the comparison allows the rounding of those sums (rtol 1e-6 on losses of about 4, i.e. a few
fp32 roundings of the loss itself); the masters and Adam moments are carried over exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.harness.checkpoints import CheckpointJob, run_jobs
from tests.harness.launch import Launch, Runs
from tests.helpers import run_cli

pytestmark = pytest.mark.slow  # four launches, about 3 minutes on 2 busy cores
STEPS, SAVE_AT, GLOBAL_BATCH = 8, 4, 6
LOADS = {1: 3, 3: 1}  # world size -> ZeRO stage it loads at


def collect(launch: Runs):
    """Save at 2 ranks, convert, then at each new layout an uninterrupted run and the universal load."""
    save_dir = launch.root / "ckpt"

    def job(stage, **kw):
        return CheckpointJob(stage=stage, precision="fp32", global_batch=GLOBAL_BATCH, dropout=0.0, **kw)

    saved = launch(Launch(run_jobs, 2, ([job(2, steps=SAVE_AT, save_at=(SAVE_AT,), save_dir=str(save_dir))],),
                          timeout=300, rank=0))[0]
    converted = run_cli("convert", "ds-to-universal", str(save_dir / f"global_step{SAVE_AT}"),
                        str(save_dir / f"global_step{SAVE_AT}_universal"), timeout=120)
    assert converted.returncode == 0, converted.stderr
    results = {"save": saved, "convert": converted}
    universal = {"checkpoint": {"load_universal": True}}
    for world, stage in LOADS.items():
        ref, load = launch(Launch(run_jobs, world, ([job(stage, steps=STEPS), job(
            stage, steps=STEPS - SAVE_AT, load=str(save_dir), extra=universal)],), timeout=400, rank=0))
        results[world] = {"ref": ref, "load": load}
    return results, save_dir


def test_the_conversion_writes_one_folder_per_parameter(runs):
    results, save_dir = runs
    folder = save_dir / f"global_step{SAVE_AT}_universal"
    assert (save_dir / "latest_universal").read_text().strip() == folder.name
    names = set(results["save"]["params"])
    written = {p.name for p in (folder / "zero").iterdir() if p.is_dir()}
    # every trained parameter once: the GPT's lm_head.weight is tied to transformer.wte.weight
    assert written == names - {"lm_head.weight"} and "transformer.wte.weight" in written
    for name in written:
        assert {p.name for p in (folder / "zero" / name).iterdir()} == {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"}
    assert "Converting ZeRO-2 checkpoint of 2 rank(s)" in results["convert"].stdout


@pytest.mark.parametrize("world", sorted(LOADS))
def test_training_continues_like_an_uninterrupted_run(runs, world):
    results, _ = runs
    ref, load = results[world]["ref"], results[world]["load"]
    assert load["loaded_steps"] == SAVE_AT and load["loaded_stream"] == SAVE_AT
    np.testing.assert_allclose(results["save"]["losses"], ref["losses"][:SAVE_AT], rtol=1e-6)
    np.testing.assert_allclose(load["losses"], ref["losses"][SAVE_AT:], rtol=1e-6)
    gap = np.abs(np.array(load["losses"]) / np.array(ref["losses"][SAVE_AT:]) - 1).max()
    print(f"universal checkpoint 2 ranks ZeRO-2 -> {world} rank(s) ZeRO-{LOADS[world]}: largest relative loss gap "
          f"{gap:.2e} over {STEPS - SAVE_AT} steps")
    assert load["lr"] == pytest.approx(ref["lr"])
