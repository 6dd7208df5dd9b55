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
