"""Saves that cannot go ahead on every rank: checkpoint.tag_validation (Fail stops every rank with a clear
error, Warn saves under rank 0's tag so the ranks' files never end up in different folders, Ignore saves
each rank under its own tag), and a write that fails on one rank only (every rank raises the same line,
nothing is committed, `latest` is untouched, no staging folder is left). One 2-rank launch runs both
(``tag_saves``), each into a folder of its own."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsrun.checkpoint import read_latest
from tests.harness.launch import Launch
from tests.harness.models import checkpoint_gpt
from tests.harness.runs import checkpoint_config


def save_failures(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each rank passes its own tag: Fail raises on every rank; Warn saves once, under rank 0's tag. Then a
    write fails on rank 1 only (a full disk): every rank raises the same one line instead of hanging, nothing is
    committed."""
    import dsrun
    from dsrun.checkpoint import CheckpointTagError, atomic

    out: dict[str, Any] = {}
    for mode in ("Fail", "Warn"):
        model = checkpoint_gpt(0.0)
        cfg = checkpoint_config(1, "fp32", 2, {"checkpoint": {"tag_validation": mode}})
        engine, *_ = dsrun.initialize(model=model, config=cfg)
        try:
            engine.save_checkpoint(f"{root}/{mode}", tag=f"mine{rank}")
            out[mode] = "saved"
        except AssertionError as exc:  # what DeepSpeed raises there; dsrun's CheckpointTagError is one
            assert isinstance(exc, CheckpointTagError)
            out[mode] = str(exc)
    real_save = atomic.save_torch

    def full_disk(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if atomic._modes.counting:  # counting what the save needs writes nothing: let it count
            return real_save(obj, path, *args, **kwargs)
        raise OSError(28, "No space left on device")

    if rank == 1:
        atomic.save_torch = full_disk
    try:
        engine.save_checkpoint(f"{root}/Warn", tag="broken")
        out["disk"] = "saved"
    except Exception as exc:
        out["disk"] = f"{type(exc).__name__}: {exc}"
    finally:
        atomic.save_torch = real_save
    return out


def save_own_tags(rank: int, world: int, root: str) -> list[str]:
    """DeepSpeed's TestCheckpointUniqueTag with tag_validation Ignore: each rank saves under its own tag."""
    import dsrun

    engine, *_ = dsrun.initialize(model=checkpoint_gpt(0.0, False),
                                  config=checkpoint_config(1, "fp32", 2, {"checkpoint": {"tag_validation": "Ignore"}}))
    engine.save_checkpoint(root, tag=f"tag-{rank}")
    return sorted(p.name for p in (Path(root) / f"tag-{rank}").iterdir())


def tag_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank entry point: each rank's own tags (into ``root/own_tags``), then the failing saves (``root/failures``)."""
    from dsrun import comm

    out = {"own_tags": save_own_tags(rank, world, f"{root}/own_tags"),
           "failures": save_failures(rank, world, f"{root}/failures")}
    comm.destroy_process_group()
    return out


def launches(root: Path) -> dict[str, Launch]:
    for folder in ("own_tags", "failures"):  # each run saves into a folder that exists, as into tmp_path
        (root / folder).mkdir(exist_ok=True)
    return {"saves": Launch(tag_saves, 2, (str(root),), timeout=200)}


@pytest.mark.slow
def test_save_failures(runs):
    tmp_path = runs.root / "failures"
    results = [rank["failures"] for rank in runs["saves"]]
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
def test_tag_validation_ignore_saves_each_rank_under_its_own_tag(runs):
    tmp_path = runs.root / "own_tags"
    files = [rank["own_tags"] for rank in runs["saves"]]
    assert files[0] == ["mp_rank_00_model_states.pt", "rng_states_rank_0.pt",
                        "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert files[1] == ["rng_states_rank_1.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert read_latest(tmp_path) == "tag-0"  # rank 0 writes latest, as in DeepSpeed
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging left behind
