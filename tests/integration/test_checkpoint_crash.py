"""A save killed (SIGKILL) at any point never leaves ``latest`` naming an incomplete checkpoint, and the next
launch resumes from the newest complete one.

One chain of 2-rank launches: each loads ``latest``, checks it got the step it should, trains two steps and
saves with a crash armed at the next point (on rank 0 or rank 1). The point ``old_tag_moved_aside`` re-saves
the very tag ``latest`` names, so the crash falls between moving the old folder aside and renaming the new
one in.
"""
from __future__ import annotations

import pytest

from dsrun.checkpoint import layout
from dsrun.checkpoint.safe_load import load_file
from tests.harness.checkpoints import CheckpointJob, run_jobs
from tests.helpers import run_ranks

# (point, crashing rank, does `latest` move to the new checkpoint?)
# Six of atomic.CRASH_POINTS, one per phase of a save (each costs a 2-rank launch on a 2-core machine).
CHAIN = [
    ("staging_created", 1, False),      # before any file
    ("model_states_torn", 0, False),    # a half-written model states file
    ("after_optim_states", 1, False),   # one rank done, the other waiting at the barrier
    ("old_tag_moved_aside", 0, False),  # mid-swap of a re-saved tag
    ("latest_tmp_written", 0, False),   # new folder in place, `latest` not yet renamed
    ("after_latest", 0, True),          # everything done but the final barrier
]


def _assert_latest_complete(root, world: int, steps: int) -> None:
    tag = layout.read_latest(root)
    assert tag == f"global_step{steps}"
    tag_dir = layout.resolve_tag_dir(root, tag)
    assert tag_dir is not None
    states = load_file(tag_dir / "mp_rank_00_model_states.pt")  # loads: not torn
    assert states["global_steps"] == steps
    for rank in range(world):
        assert load_file(tag_dir / layout.optim_states_name(rank, bf16=False))["optimizer_state_dict"]["zero_stage"] == 2
        load_file(tag_dir / layout.rng_states_name(rank))


@pytest.mark.slow
def test_killed_saves_never_corrupt_latest(tmp_path):
    root = str(tmp_path / "ckpt")
    job = CheckpointJob(stage=2, precision="fp32", steps=2, global_batch=4, save_dir=root)
    run_ranks(run_jobs, 2, [job.but(save_at=(2,))], timeout=200)
    complete = 2
    seen_points = []
    for point, crash_rank, moves in CHAIN:
        _assert_latest_complete(tmp_path / "ckpt", 2, complete)
        crash = job.but(load=root, save_at=(complete + 2,), crash_at=point, crash_rank=crash_rank)
        if point == "old_tag_moved_aside":
            crash = crash.but(save_tag=f"global_step{complete}")  # re-save the tag `latest` names
        with pytest.raises(AssertionError, match="exit|failed"):
            run_ranks(run_jobs, 2, [crash], timeout=200)
        seen_points.append(point)
        if moves:
            complete += 2
        _assert_latest_complete(tmp_path / "ckpt", 2, complete)
    resumed = run_ranks(run_jobs, 2, [job.but(load=root, save_at=(complete + 2,))], timeout=200)[0][0]
    assert resumed["loaded_steps"] == complete and resumed["loaded_stream"] == complete
    assert len(seen_points) >= 5
    _assert_latest_complete(tmp_path / "ckpt", 2, complete + 2)
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]
    assert leftovers == []  # the successful save cleaned up after the crashed ones
