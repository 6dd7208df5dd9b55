"""Resharding: a checkpoint saved by N ranks continues on M ranks (4 -> 2 and 2 -> 3) for ZeRO stages 1, 2
and 3, with losses equal to an uninterrupted run at the new world size (same global batch).

Across world sizes the gradient all-reduce sums in a different order, so two runs differ by rounding, not
bitwise; the bound between them is derived from the arithmetic (tests/tolerance.py: ``2 K x``
the spread of valid fp32 orderings of the PyTorch reference around its float64 run). The parameters and
Adam moments themselves are moved exactly (the unit tests check the round trip bit for bit).
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests import tolerance as t
from tests.harness.checkpoints import CheckpointJob, checkpoint_reference, flat_state, run_jobs
from tests.harness.launch import Launch, Runs
from tests.harness.models import SEQ

STAGES = (1, 2, 3)
STEPS, SAVE_AT = 8, 4
CASES = {"4to2": (4, 2, 4), "2to3": (2, 3, 6)}  # name -> (saved world, new world, global batch)


def collect(launch: Runs) -> dict:
    """The saves (at 2 and 4 ranks) first, then the loads and the uninterrupted runs at the new world sizes."""
    root = launch.root

    def job(stage, case, **kw):
        return CheckpointJob(stage=stage, precision="fp32", global_batch=CASES[case][2], dropout=0.0, **kw)

    def saved(stage, case):
        return str(root / f"{case}-{stage}")

    by_world: dict[int, list[tuple[str, dict]]] = {2: [], 3: [], 4: []}
    for stage in STAGES:
        by_world[2].append((f"ref/4to2/{stage}", job(stage, "4to2", steps=STEPS)))
        by_world[2].append((f"save/2to3/{stage}", job(stage, "2to3", steps=SAVE_AT, save_at=(SAVE_AT,),
                                                        save_dir=saved(stage, "2to3"))))
        by_world[4].append((f"save/4to2/{stage}", job(stage, "4to2", steps=SAVE_AT, save_at=(SAVE_AT,),
                                                        save_dir=saved(stage, "4to2"))))
        by_world[3].append((f"ref/2to3/{stage}", job(stage, "2to3", steps=STEPS)))
    results = {}
    for world in (2, 4):  # the saves first
        out = launch(Launch(run_jobs, world, ([j for _, j in by_world[world]],), timeout=500, rank=0))
        results.update({name: r for (name, _), r in zip(by_world[world], out)})
    loads = {2: [(f"load/4to2/{s}", job(s, "4to2", steps=STEPS - SAVE_AT, load=saved(s, "4to2"))) for s in STAGES],
             3: [(f"load/2to3/{s}", job(s, "2to3", steps=STEPS - SAVE_AT, load=saved(s, "2to3"))) for s in STAGES]
             + by_world[3]}
    for world, named in loads.items():
        out = launch(Launch(run_jobs, world, ([j for _, j in named],), timeout=500, rank=0))
        results.update({name: r for (name, _), r in zip(named, out)})
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("stage", STAGES)
def test_resharded_run_continues_like_an_uninterrupted_one(runs, case, stage):
    ref, save, load = (runs[f"{kind}/{case}/{stage}"] for kind in ("ref", "save", "load"))
    assert load["loaded_steps"] == SAVE_AT and load["loaded_stream"] == SAVE_AT
    s = spread(CASES[case][2])
    # the old world size trained the first steps like the new one would have
    t.assert_tracks({"losses": save["losses"]}, {"losses": ref["losses"][:SAVE_AT]}, s, "before the save",
                    against="run", what=("losses",))
    # and after the reshard the new world size continues on the same curve, to the same parameters (Adam
    # turns the rounding noise of near-zero gradients into visible parameter noise: the spread measures it)
    t.assert_tracks({"losses": load["losses"], "params": flat_state(load["params"])},
                    {"losses": ref["losses"][SAVE_AT:], "params": flat_state(ref["params"])}, s, "after the reshard",
                    against="run")
    assert load["lr"] == pytest.approx(ref["lr"])


@functools.lru_cache(maxsize=None)
def spread(global_batch: int) -> t.Spread:
    return t.spread(lambda d, parts, reverse: checkpoint_reference(global_batch, STEPS, d, parts, reverse), torch.float32,
                    global_batch * SEQ)
