"""Resharding: a checkpoint saved by N ranks continues on M ranks (4 -> 2 and 2 -> 3) for ZeRO stages 1, 2
and 3, with losses equal to an uninterrupted run at the new world size (same global batch).

Across world sizes the gradient all-reduce sums in a different order, so two runs differ by rounding, not
bitwise; the bound between them is derived from the arithmetic (tests/tolerance.py: ``2 K x``
the spread of valid fp32 orderings of the PyTorch reference around its float64 run). The parameters and
Adam moments themselves are moved exactly (the unit tests check the round trip bit for bit).

``zero_optimization.elastic_checkpoint`` (stages 1-2, DeepSpeed's elastic layout): the uninterrupted 3-rank runs
save at step 4 in that layout (the last rank's partition is padded there, 27776 elements over 6 slots), and 2
ranks continue from it (3to2), against the same uninterrupted run.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from dsrun.checkpoint import load_file
from tests import tolerance as t
from tests.harness.checkpoints import CheckpointJob, checkpoint_reference, flat_state, run_jobs
from tests.harness.launch import Launch, Runs
from tests.harness.models import SEQ

STAGES = (1, 2, 3)
STEPS, SAVE_AT = 8, 4
CASES = {"4to2": (4, 2, 4), "2to3": (2, 3, 6)}  # name -> (saved world, new world, global batch)
ELASTIC, ELASTIC_STAGES = {"elastic_checkpoint": True}, (1, 2)


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
        elastic = dict(save_at=(SAVE_AT,), save_dir=saved(stage, "3to2"), zero=ELASTIC) if stage in ELASTIC_STAGES else {}
        by_world[3].append((f"ref/2to3/{stage}", job(stage, "2to3", steps=STEPS, **elastic)))
    results = {}
    for world in (2, 4):  # the saves first
        out = launch(Launch(run_jobs, world, ([j for _, j in by_world[world]],), timeout=500, rank=0))
        results.update({name: r for (name, _), r in zip(by_world[world], out)})
    loads = {3: [(f"load/2to3/{s}", job(s, "2to3", steps=STEPS - SAVE_AT, load=saved(s, "2to3"))) for s in STAGES]
             + by_world[3],  # first: its uninterrupted runs save the elastic checkpoints the 2 ranks load
             2: [(f"load/4to2/{s}", job(s, "4to2", steps=STEPS - SAVE_AT, load=saved(s, "4to2"))) for s in STAGES]
             + [(f"load/3to2/{s}", job(s, "2to3", steps=STEPS - SAVE_AT, load=saved(s, "3to2"), zero=ELASTIC))
                for s in ELASTIC_STAGES]}
    for world, named in loads.items():
        out = launch(Launch(run_jobs, world, ([j for _, j in named],), timeout=500, rank=0))
        results.update({name: r for (name, _), r in zip(named, out)})
    for stage in ELASTIC_STAGES:  # what the 3 ranks wrote: per rank, its masters' and its moments' lengths
        files = sorted(Path(saved(stage, "3to2"), f"global_step{SAVE_AT}").glob("*optim_states.pt"))
        states = [load_file(f)["optimizer_state_dict"] for f in files]
        results[f"layout/{stage}"] = [(len(sd["single_partition_of_fp32_groups"][0]),
                                       len(sd["base_optimizer_state"][0]["exp_avg"]), sd["group_paddings"][0],
                                       sd["base_optimizer_state_step"]) for sd in states]
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


@pytest.mark.slow
@pytest.mark.parametrize("stage", ELASTIC_STAGES)
def test_elastic_checkpoint_continues_on_another_world_size(runs, stage):
    """Saved by 3 ranks in DeepSpeed's elastic layout: each rank's optimizer state is a list of per-group
    states without the padding (the last rank's moments 4 elements shorter than its padded partition, as its
    unpadded master), the step beside it; 2 ranks (elastic too) continue the uninterrupted 3-rank run."""
    numel = sum(sd[0] for sd in runs[f"layout/{stage}"])
    part = -(-numel // 6) * 2  # 27776 padded to a multiple of 2 x 3, in 3 slices
    assert runs[f"layout/{stage}"] == [(part, part, 0, SAVE_AT), (part, part, 0, SAVE_AT),
                                       (numel - 2 * part, numel - 2 * part, 3 * part - numel, SAVE_AT)]
    assert 3 * part > numel  # the last rank is padded: its saved moments are cut to its master's length
    ref, load = runs[f"ref/2to3/{stage}"], runs[f"load/3to2/{stage}"]
    assert load["loaded_steps"] == SAVE_AT and load["loaded_stream"] == SAVE_AT
    t.assert_tracks({"losses": load["losses"], "params": flat_state(load["params"])},
                    {"losses": ref["losses"][SAVE_AT:], "params": flat_state(ref["params"])}, spread(6),
                    "after the elastic reshard", against="run")
    assert load["lr"] == pytest.approx(ref["lr"])


@functools.lru_cache(maxsize=None)
def spread(global_batch: int) -> t.Spread:
    return t.spread(lambda d, parts, reverse: checkpoint_reference(global_batch, STEPS, d, parts, reverse), torch.float32,
                    global_batch * SEQ)
