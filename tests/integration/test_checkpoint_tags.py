"""Saves that cannot go ahead on every rank: checkpoint.tag_validation (Fail stops every rank with a clear
error, Warn saves under rank 0's tag so the ranks' files never end up in different folders), and a write that
fails on one rank only (every rank raises the same line, nothing is committed, `latest` is untouched, no
staging folder is left)."""

import pytest

from dsrun.checkpoint import read_latest
from tests.helpers import run_ranks
from tests.integration._ckpt_workloads import save_failures

@pytest.mark.slow
def test_save_failures(tmp_path):
    results = run_ranks(save_failures, 2, str(tmp_path), timeout=200)
    for rank, result in enumerate(results):
        assert f"the tag differs across ranks (rank {rank} has 'mine{rank}')" in result["Fail"]
        assert result["Warn"] == "saved"
    assert not (tmp_path / "Fail").exists()  # checked before anything is written
    assert read_latest(tmp_path / "Warn") == "mine0"
    assert sorted(p.name for p in (tmp_path / "Warn" / "mine0").iterdir()) == [
        "mp_rank_00_model_states.pt", "rng_states_rank_0.pt", "rng_states_rank_1.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # the full disk is named on both ranks alike, with what the save needs: the same state as mine0's files
    needed = sum(p.stat().st_size for p in (tmp_path / "Warn" / "mine0").iterdir())
    assert results[0]["disk"] == results[1]["disk"]
    assert results[1]["disk"].startswith(f"UserError: save_checkpoint: no space left on device while saving broken "
                                         f"in {tmp_path / 'Warn'} ({needed:,} bytes needed, ")
    assert results[1]["disk"].endswith("nothing of it was kept, mine0 is still the newest checkpoint (free space "
                                       "there or save to a bigger disk; dsrun train: train.keep_last=N keeps fewer "
                                       "checkpoints)")
    assert read_latest(tmp_path / "Warn") == "mine0" and not (tmp_path / "Warn" / "broken").exists()
    assert not any(p.name.startswith(".") for p in (tmp_path / "Warn").iterdir())  # no staging folder left


@pytest.mark.slow
def test_tag_validation_ignore_saves_each_rank_under_its_own_tag(tmp_path):
    from tests.integration._ckpt_workloads import save_own_tags

    files = run_ranks(save_own_tags, 2, str(tmp_path), timeout=200)
    assert files[0] == ["mp_rank_00_model_states.pt", "rng_states_rank_0.pt",
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert files[1] == ["rng_states_rank_1.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert read_latest(tmp_path) == "tag-0"  # rank 0 writes latest, as in DeepSpeed
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging left behind
