"""Where ``train.resume`` finds its checkpoint, and the worker hooks' save/keep_last behaviour on one rank."""
from __future__ import annotations

import pytest

from dsrun.checkpoint.training import TrainingCheckpoints, find_checkpoint
from dsrun.utils.errors import UserError


def _checkpoint(root, tags=("global_step2",)):
    for tag in tags:
        (root / tag).mkdir(parents=True)
        (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (root / "latest").write_text(tags[-1])
    return root


def test_resume_targets(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert find_checkpoint(None, run_dir) is None
    assert find_checkpoint("auto", run_dir) is None  # nothing saved yet: start fresh
    own = _checkpoint(run_dir / "checkpoints")
    assert find_checkpoint("auto", run_dir) == (own, None)
    assert find_checkpoint(str(run_dir), tmp_path) == (own, None)  # a run directory
    assert find_checkpoint(str(own), tmp_path) == (own, None)  # a checkpoint folder
    assert find_checkpoint(str(own / "global_step2"), tmp_path) == (own, "global_step2")  # one tag
    with pytest.raises(UserError, match="train.resume: no checkpoint at"):
        find_checkpoint(str(tmp_path / "missing"), run_dir)


class _Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"consumed_samples": self.position}

    def load_state_dict(self, sd):
        self.position = sd["consumed_samples"]


@pytest.mark.usefixtures("single_rank")
def test_hooks_save_on_interval_keep_last_and_resume(tmp_path):
    from .conftest import make_engine, train

    engine, loader = make_engine(1), _Loader()
    hooks = TrainingCheckpoints(engine, loader, tmp_path, save_interval=2, resume=None, keep_last=2)
    for step in range(1, 8):
        train(engine, 1, start=step - 1)
        loader.position = step * 4
        saved = hooks.save_if_due(step, force=step == 7)
        assert saved == (step % 2 == 0 or step == 7)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["global_step6", "global_step7"]
    assert (ckpts / "latest").read_text() == "global_step7"
    assert not hooks.save_if_due(7, force=True)  # already saved at this step

    fresh_engine, fresh_loader = make_engine(1), _Loader()
    again = TrainingCheckpoints(fresh_engine, fresh_loader, tmp_path, save_interval=2, resume="auto", keep_last=2)
    assert again.resume() == 7 and fresh_loader.position == 28


@pytest.mark.usefixtures("single_rank")
def test_a_run_saves_at_its_last_step_once_whatever_the_interval(tmp_path):
    """max_steps=3 with save_interval=100 keeps its 3 steps; max_steps=4 with save_interval=2 saves 2 and 4 once."""
    from .conftest import make_engine, train

    for last_step, interval, due in ((3, 100, [3]), (4, 2, [2, 4])):
        run_dir = tmp_path / f"run{last_step}"
        engine, loader = make_engine(1), _Loader()
        hooks = TrainingCheckpoints(engine, loader, run_dir, save_interval=interval, resume=None, keep_last=0,
                                    last_step=last_step)
        saved = []
        for step in range(1, last_step + 1):
            train(engine, 1, start=step - 1)
            saved += [step] if hooks.save_if_due(step) else []
        assert saved == due
        assert (run_dir / "checkpoints" / "latest").read_text() == f"global_step{last_step}"
        off = TrainingCheckpoints(engine, loader, tmp_path / "off", save_interval=0, resume=None, keep_last=0,
                                  last_step=last_step)
        assert not off.save_if_due(last_step) and not (tmp_path / "off" / "checkpoints").exists()


@pytest.mark.usefixtures("single_rank")
def test_a_preempted_run_saves_where_it_stops_even_with_saving_off(tmp_path):
    from .conftest import make_engine, train

    engine, loader = make_engine(1), _Loader()
    hooks = TrainingCheckpoints(engine, loader, tmp_path, save_interval=0, resume=None, keep_last=2, last_step=10)
    train(engine, 2)
    assert not hooks.save_if_due(2, force=True)  # Ctrl-C: saves only when saving is on
    assert hooks.save_if_due(2, force=True, always=True)  # SIGTERM/SIGUSR1: the run must be resumable
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step2"
    assert not hooks.save_if_due(2, force=True, always=True)  # once per step


@pytest.mark.parametrize("interval, metrics, says", [
    (100, {"steps": 30}, "it stopped at step 30 before its first save at 100"),
    (100, {"steps": 20, "resumed_from_step": 10}, "it stopped at step 30 before its first save at 100"),
    (100, None, "it ended before its first save at 100 and wrote no metrics.json"),
    (0, {"steps": 30}, "it trained with train.save_interval=0"),
])
def test_export_and_generate_name_why_a_run_has_no_checkpoint(tmp_path, interval, metrics, says):
    """The hint of `dsrun export` / `dsrun generate` (and a teacher run) for a run without a checkpoint is what
    its own records say, not "train with train.save_interval > 0" to a run that had it at 100."""
    import json

    from dsrun.compression.from_run import export_run
    from dsrun.compression.layer_reduction import load_teacher
    from dsrun.inference.loading import read_state_dict

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "resolved.yaml").write_text(f"train:\n  max_steps: 30\n  save_interval: {interval}\n")
    if metrics is not None:
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
    for load, key in ((lambda: export_run(run_dir, tmp_path / "out"), "RUN_DIR"),
                      (lambda: read_state_dict(str(run_dir)), "init_inference.checkpoint"),
                      (lambda: load_teacher(str(run_dir)), "train.teacher")):
        with pytest.raises(UserError) as caught:
            load()
        (problem,) = caught.value.problems
        assert problem.path == key and problem.message.startswith(f"{run_dir} has no checkpoint: {says}")
        assert f"dsrun train --from {run_dir}" in problem.hint


@pytest.mark.usefixtures("single_rank")
def test_a_full_disk_is_named_with_the_bytes_and_leaves_no_staging_folder(tmp_path):
    """ENOSPC during a save (a real 64 KiB tmpfs) is one user error naming the tag, the bytes the save needs and
    the bytes free; the partial staging folder is removed, so the space is free again (the logs need it)."""
    import shutil

    from tests.helpers import small_disk

    from .conftest import make_engine, train

    engine = make_engine(1)
    train(engine, 1)
    whole = tmp_path / "whole"
    engine.save_checkpoint(str(whole))  # the same state on a roomy disk: the bytes it really takes
    needed = sum(p.stat().st_size for p in (whole / "global_step1").iterdir())
    with small_disk(tmp_path / "disk", "64k") as disk:
        assert needed > shutil.disk_usage(disk).total  # it cannot fit
        with pytest.raises(UserError) as caught:
            engine.save_checkpoint(str(disk / "ckpt"))
        (problem,) = caught.value.problems
        assert problem.path == "save_checkpoint"
        assert problem.message == (f"no space left on device while saving global_step1 in {disk / 'ckpt'} "
                                   f"({needed:,} bytes needed, {shutil.disk_usage(disk).free:,} free); "
                                   "nothing of it was kept")
        assert [p.name for p in (disk / "ckpt").iterdir()] == []  # no staging folder, no partial file
