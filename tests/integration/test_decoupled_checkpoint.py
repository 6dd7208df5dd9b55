"""Decoupled saves (``checkpoint.writer.decoupled``, docs/checkpoint.md): training waits only for the snapshot,
the background write publishes the checkpoint once every rank's files are durable.

* A 2-rank ZeRO-3 run whose save at step 2 is held on the writer thread (``DecoupledWriter.before_write``) while
  steps 3 and 4 update the very tensors the snapshot copied; a save at step 3 meanwhile is skipped on both ranks
  (the write in flight, a short ``max_wait_s``); once released, the checkpoint resumes to the uninterrupted
  run's weights bit for bit: the snapshot did not alias what training mutates.
* A rank SIGKILLed at each of the 3 points of a background write (``atomic.DECOUPLED_CRASH_POINTS``: a
  half-written file; its files durable before the ranks agree; nothing written yet) leaves ``latest`` naming the
  previous complete checkpoint, whose files load; the next launch's engine loads it and its save tidies the
  staging folder the crash left.
* ``dsrun train``'s worker with ``checkpoint=decoupled`` records every save in ``metrics.json``
  (``checkpoint_saves``) and in the CSV monitor.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dsrun.checkpoint import layout
from dsrun.checkpoint.safe_load import load_file
from tests.harness.checkpoints import CheckpointJob, StepStream, run_jobs
from tests.helpers import run_ranks

DECOUPLED = {"checkpoint": {"writer": {"decoupled": True}}}


def _train(engine: Any, stream: StepStream, steps: int) -> None:
    for _ in range(steps):
        batch = stream.next()
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()


def held_save_then_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train 4 steps saving at 2 (held until step 4 ends) and trying at 3; then resume from step 2 in a new engine
    and train 2 steps. Returns both runs' weights and what the saves did."""
    import dsrun
    from dsrun import comm
    from dsrun.checkpoint import decoupled
    from tests.harness.models import checkpoint_gpt
    from tests.harness.runs import checkpoint_config, full_state

    def engine_of() -> Any:
        model = checkpoint_gpt(0.1, False)
        config = checkpoint_config(3, "fp32", 4 // world, DECOUPLED)
        return dsrun.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    torch.manual_seed(11 + rank)
    engine, stream, release = engine_of(), StepStream(4, rank, world), threading.Event()
    _train(engine, stream, 2)
    writer = decoupled.writer()  # what the first decoupled save creates (collectively), made first to hold it
    writer.before_write, writer.max_wait_s = (lambda job: release.wait()), 0.05
    engine.save_checkpoint(root, client_state={"stream": stream.state_dict()})
    _train(engine, stream, 1)
    skipped = engine.save_checkpoint(root, client_state={"stream": stream.state_dict()})  # step 2's still held
    _train(engine, stream, 1)
    unpublished = layout.read_latest(root)
    release.set()
    writer.before_write = None
    decoupled.drain()
    uninterrupted = {k: v.numpy() for k, v in full_state(engine).items()}

    torch.manual_seed(99)  # the checkpoint's RNG states must win
    resumed = engine_of()
    _, client = resumed.load_checkpoint(root)
    stream = StepStream(4, rank, world)
    stream.load_state_dict(client["stream"])
    loaded_step = resumed.global_steps
    _train(resumed, stream, 2)
    comm.barrier()
    return {"skipped": skipped, "unpublished": unpublished, "loaded_step": loaded_step,
            "uninterrupted": uninterrupted, "resumed": {k: v.numpy() for k, v in full_state(resumed).items()}}


def test_a_decoupled_save_resumes_bit_exactly_while_training_goes_on(tmp_path):
    root = tmp_path / "ckpt"
    results = run_ranks(held_save_then_resume, 2, str(root), timeout=200)
    for rank, result in enumerate(results):
        assert result["unpublished"] is None, rank  # steps 3 and 4 ran while the write was held
        assert result["skipped"] is False, rank  # the save at step 3 found the write in flight: skipped, both ranks
        assert result["loaded_step"] == 2, rank
        assert result["resumed"].keys() == result["uninterrupted"].keys()
        for name, value in result["uninterrupted"].items():
            assert (result["resumed"][name] == value).all(), (rank, name)
    assert layout.read_latest(root) == "global_step2" and layout.list_tags(root) == ["global_step2"]


# (point, crashing rank): one of each part of a background write; the two that leave files in the staging folder
# first, so that the next launch's engine loads `latest` beside them (and its save tidies them away)
POINTS = [("decoupled_file_torn", 0), ("decoupled_files_durable", 1), ("decoupled_write_started", 1)]


def _reached(point: str, staging: Path) -> bool:
    """Whether the staging folder shows the crash happened at ``point`` (not earlier, e.g. at a failed prepare)."""
    names = {p.name for p in staging.iterdir()}
    if point == "decoupled_file_torn":  # rank 0's first file, half written under its temporary name
        return any(n.startswith(".mp_rank_00_model_states.pt.tmp") for n in names)
    rank1 = {layout.optim_states_name(1, bf16=False), layout.rng_states_name(1)}
    return rank1 <= names if point == "decoupled_files_durable" else not rank1 & names


def _assert_latest_loads(root: Path, step: int) -> None:
    tag = layout.read_latest(root)
    assert tag == f"global_step{step}"
    tag_dir = layout.resolve_tag_dir(root, tag)
    assert load_file(tag_dir / "mp_rank_00_model_states.pt")["global_steps"] == step
    for rank in range(2):
        assert load_file(tag_dir / layout.optim_states_name(rank, bf16=False))["optimizer_state_dict"]["zero_stage"] == 2


@pytest.mark.slow
def test_a_rank_killed_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    """3 launches: the first saves step 2 (published before the next save starts) and is killed in step 4's
    write; each next one loads `latest` with its engine (the previous crash's aftermath) and is killed at the
    next point. After each, `latest` names step 2 and its files load."""
    root = str(tmp_path / "ckpt")
    job = CheckpointJob(stage=2, precision="fp32", steps=2, global_batch=4, save_dir=root, extra=DECOUPLED)
    for index, (point, crash_rank) in enumerate(POINTS):
        crash = job.but(load=root, save_at=(4,)) if index else job.but(steps=4, save_at=(2, 4))
        with pytest.raises(AssertionError, match="exit|failed"):
            run_ranks(run_jobs, 2, [crash.but(crash_at=point, crash_rank=crash_rank)], timeout=200)
        _assert_latest_loads(tmp_path / "ckpt", 2)  # the previous complete checkpoint is still `latest`
        assert layout.list_tags(tmp_path / "ckpt") == ["global_step2"], point
        leftovers = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("."))
        assert leftovers == [".global_step4.staging"], (point, leftovers)  # only this crash's: earlier ones tidied
        assert _reached(point, tmp_path / "ckpt" / leftovers[0]), point


def test_the_worker_records_every_decoupled_save_in_metrics_and_monitors(tmp_path):
    """``dsrun train ... checkpoint=decoupled train.save_interval=2 monitor=csv``, its ranks as the launcher's."""
    from dsrun.compose import compose_runspec
    from dsrun.rundir import write_run_files
    from dsrun.runspec import resolve_run
    from tests.integration.test_preemption import TINY, preempted_rank

    mine = ("train.resume", "train.max_steps", "monitor=")
    overrides = [o for o in TINY if not o.startswith(mine)] + [
        "checkpoint=decoupled", "train.save_interval=2", "train.max_steps=4", "monitor=csv"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    resolved = resolve_run(compose_runspec(overrides))
    assert resolved.ds.checkpoint.writer.decoupled
    write_run_files(run_dir, resolved)
    codes = [code for code, _ in run_ranks(preempted_rank, 2, run_dir, None, 0, (), timeout=300)]
    assert codes == [0, 0]
    saves = json.loads((run_dir / "metrics.json").read_text())["checkpoint_saves"]
    assert [s["step"] for s in saves] == [2, 4]
    checkpoints = run_dir / "checkpoints"
    for save in saves:
        assert save["blocking_s"] > 0 and save["write_s"] > 0
        folder = checkpoints / f"global_step{save['step']}"
        assert save["bytes"] == sum(p.stat().st_size for p in folder.iterdir())
    assert layout.read_latest(checkpoints) == "global_step4"  # the last write was published before the end
    for name in ("blocking_s", "write_s", "bytes"):
        rows = (run_dir / "dsrun" / f"Checkpoint_Samples_{name}.csv").read_text().splitlines()[1:]
        assert [float(r.split(",")[1]) for r in rows] == [float(s[name]) for s in saves], name
