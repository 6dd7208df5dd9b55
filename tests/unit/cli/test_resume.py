"""Where a run resumes from: train.resume=auto across earlier run directories, --from RUN_DIR, and the
closing lines of a stopped run."""
import json
import os
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dsrun.cli.outcome import stopped_lines, where_outputs_went
from dsrun.cli.resume import effective_overrides, settle_auto, settle_from, shaping_overrides
from dsrun.compose import compose_runspec
from dsrun.runspec import resolve_run

MINE = ["+recipe=default", "optimizer.params.lr=0.002", "train.resume=auto", "launcher.master_port=1234"]


def resolved(*overrides):
    return resolve_run(compose_runspec(["data.max_bytes=300000", *overrides]))


def earlier_run(root: Path, name: str, overrides: list[str], step: int | None, age_s: float = 0) -> Path:
    """A run directory as dsrun train leaves it: Hydra's record of the overrides, and a checkpoint at ``step``."""
    run_dir = root / "outputs" / "2026-01-01" / name
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    if step is not None:
        tag = run_dir / "checkpoints" / f"global_step{step}"
        tag.mkdir(parents=True)
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
        latest = run_dir / "checkpoints" / "latest"
        latest.write_text(f"global_step{step}")
        when = latest.stat().st_mtime - age_s
        os.utime(latest, (when, when))
    return run_dir


def test_overrides_that_do_not_shape_the_training_do_not_count():
    assert shaping_overrides(MINE) == ["+recipe=default", "optimizer.params.lr=0.002"]
    assert shaping_overrides(["train.max_steps=600", "optimizer.params.lr=0.002", "+recipe=default"]) == \
        shaping_overrides(MINE)
    assert effective_overrides(["a=1", "b=2", "a=3"]) == ["a=3", "b=2"]


def test_auto_resumes_from_the_newest_checkpoint_of_a_run_with_the_same_overrides(tmp_path):
    older = earlier_run(tmp_path, "10-00-00", [*MINE[:2], "train.max_steps=300"], 300, age_s=100)
    newer = earlier_run(tmp_path, "11-00-00", MINE[:2], 150, age_s=10)
    earlier_run(tmp_path, "12-00-00", ["+recipe=default", "optimizer.params.lr=0.003"], 999)  # other overrides
    earlier_run(tmp_path, "13-00-00", MINE, None)  # same overrides, no checkpoint
    this = tmp_path / "outputs" / "2026-01-02" / "09-00-00"
    this.mkdir(parents=True)
    run, line = settle_auto(resolved("train.resume=auto"), this, MINE, multirun=False)
    assert run.train.resume == str(newer / "checkpoints") == run.runspec.train.resume
    assert line.startswith(f"train.resume=auto: resuming from {newer / 'checkpoints' / 'global_step150'} at step 150")
    assert older.is_dir()


def test_auto_says_where_it_looked_when_it_finds_nothing(tmp_path):
    earlier_run(tmp_path, "12-00-00", ["+recipe=default"], 5)
    this = tmp_path / "outputs" / "2026-01-02" / "09-00-00"
    this.mkdir(parents=True)
    run, line = settle_auto(resolved("train.resume=auto", "train.save_interval=0"), this, MINE, multirun=False)
    assert run.train.resume is None
    assert line == ("train.resume=auto: no checkpoint of an earlier run with the same recipe and overrides among "
                    f"the 1 run directories in {tmp_path / 'outputs'}; starting from step 0 (train.save_interval=0: "
                    "this run saves none either)")


@pytest.mark.parametrize("step, max_steps, resumes", [(4, 8, True), (8, 8, False), (None, 8, False)])
def test_from_resumes_an_unfinished_run_and_reruns_a_finished_one(tmp_path, step, max_steps, resumes):
    source = earlier_run(tmp_path, "10-00-00", MINE[:2], step)
    run, line = settle_from(resolved(f"train.max_steps={max_steps}", "train.resume=auto"), source, [])
    assert run.train.resume == (str(source / "checkpoints") if resumes else None)
    assert line.startswith("resuming" if resumes else f"rerunning {source} from step 0 (")


def test_from_reruns_a_continued_run_from_the_checkpoint_it_started_from(tmp_path):
    """A run that had resumed from another one and finished is run again from that same checkpoint."""
    origin = earlier_run(tmp_path, "09-00-00", MINE[:2], 4)
    source = earlier_run(tmp_path, "10-00-00", MINE[:2], 8)
    (source / "resolved.yaml").write_text(f"train:\n  resume: {origin / 'checkpoints'}\n")
    run, line = settle_from(resolved("train.max_steps=8"), source, [])
    assert run.train.resume == str(origin / "checkpoints")
    assert line == (f"rerunning {source} from {origin / 'checkpoints'}, the checkpoint it started from (its "
                    "checkpoint global_step8 is at the end of its 8 steps; raise train.max_steps to continue it)")
    kept, _ = settle_from(resolved("train.resume=/elsewhere"), source, ["train.resume=/elsewhere"])
    assert kept.train.resume == "/elsewhere"  # the user's own choice wins


def test_a_stopped_run_says_where_it_stopped_what_was_saved_and_how_to_resume(tmp_path):
    run_dir = earlier_run(tmp_path, "10-00-00", MINE[:2], 21)
    (run_dir / "metrics.json").write_text(json.dumps({"steps": 11, "resumed_from_step": 10, "max_steps": 300}))
    lines = stopped_lines(resolved(), run_dir, signal.SIGINT)
    assert lines[0] == (f"stopped by Ctrl-C after step 21 of 300; checkpoint saved at step 21 in "
                        f"{run_dir / 'checkpoints' / 'global_step21'}")
    assert lines[1] == f"resume: dsrun train --from {run_dir}"
    bare = earlier_run(tmp_path, "11-00-00", MINE[:2], None)
    assert stopped_lines(resolved("train.save_interval=0"), bare, signal.SIGTERM) == [
        "stopped by SIGTERM before the first step finished; no checkpoint saved (train.save_interval=0)",
        f"run it again: dsrun train --from {bare}"]


def test_a_monitor_that_wrote_nothing_is_not_advertised(tmp_path):
    empty = tmp_path / "tb"
    run = resolved("monitor=all", f"ds.tensorboard.output_path={empty}")
    (tmp_path / "dsrun").mkdir()
    (tmp_path / "dsrun" / "Train_Samples_train_loss.csv").write_text("step,value\n")
    lines = where_outputs_went(run, tmp_path)
    assert f"csv_monitor: {tmp_path / 'dsrun'}" in lines
    assert f"tensorboard: nothing was written to {empty / 'dsrun'} (see the rank 0 log)" in lines


def _damage(checkpoints: Path, how: str) -> None:
    latest = checkpoints / "latest"
    if how == "missing tag":
        latest.write_text("global_step100")
    elif how == "garbage":
        latest.write_bytes(b"\xff\xfe\x00garbage")
    elif how == "empty":
        latest.write_text("")
    else:
        latest.unlink()


@pytest.mark.parametrize("how", ["missing tag", "garbage", "empty", "no latest"])
def test_from_and_train_resume_refuse_a_damaged_latest_alike_naming_the_newest_complete_tag(tmp_path, how):
    """--from used to rerun from step 0 in silence when `latest` was damaged although global_step60 and
    global_step80 were intact; train.resume=RUN refused it. One rule now: refused, naming global_step80."""
    import torch

    from dsrun.cli.preflight import resume_problems
    from dsrun.utils.errors import UserError

    source = earlier_run(tmp_path, "10-00-00", MINE[:2], 60)
    checkpoints = source / "checkpoints"
    (checkpoints / "global_step80").mkdir()
    for tag in ("global_step60", "global_step80"):
        torch.save({"global_steps": int(tag[11:])}, checkpoints / tag / "mp_rank_00_model_states.pt")
    _damage(checkpoints, how)
    with pytest.raises(UserError) as caught:
        settle_from(resolved("train.max_steps=100"), source, [])
    (by_from,) = caught.value.problems
    assert by_from.path == "--from" and by_from.message.endswith("(complete tags there: global_step60, global_step80)")
    assert by_from.hint.startswith("resume from the newest complete one: "
                                   f"dsrun train --from {source} train.resume={checkpoints / 'global_step80'}")
    (by_resume,) = resume_problems(str(source))
    assert (by_resume.path, by_resume.message) == ("train.resume", by_from.message)
    assert by_resume.hint.startswith(f"resume from the newest complete one: train.resume={checkpoints / 'global_step80'}")
    # the suggestion works: the user's train.resume wins and names a whole checkpoint
    suggested = f"train.resume={checkpoints / 'global_step80'}"
    run, _ = settle_from(resolved("train.max_steps=100", suggested), source, [suggested])
    assert resume_problems(run.train.resume) == []
    with pytest.raises(UserError, match=r"^train.resume: .*complete tags there: global_step60, global_step80"):
        this = tmp_path / "outputs" / "2026-01-02" / "09-00-00"
        this.mkdir(parents=True, exist_ok=True)
        settle_auto(resolved("train.resume=auto"), this, MINE, multirun=False)


def test_auto_on_a_finished_run_says_so_and_launches_nothing(tmp_path):
    from dsrun.cli.resume import RunFinished

    done = earlier_run(tmp_path, "10-00-00", MINE[:2], 300)
    (done / "metrics.json").write_text(json.dumps({"final_eval_loss": 2.31}))
    this = tmp_path / "outputs" / "2026-01-02" / "09-00-00"
    this.mkdir(parents=True)
    with pytest.raises(RunFinished) as caught:
        settle_auto(resolved("train.resume=auto", "train.max_steps=300"), this, MINE, multirun=False)
    assert str(caught.value) == (
        f"train.resume=auto: the newest run with the same recipe and overrides, {done}, finished: its checkpoint "
        "global_step300 is at step 300 of train.max_steps=300; nothing to train (raise train.max_steps to train "
        "it longer, e.g. train.max_steps=600)")
    assert caught.value.final_eval_loss() == 2.31
    run, line = settle_auto(resolved("train.resume=auto", "train.max_steps=600"), this, MINE, multirun=False)
    assert run.train.resume == str(done / "checkpoints") and "at step 300" in line  # longer: it continues
