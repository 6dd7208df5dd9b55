"""A user's mistake in `dsrun train` is one line and exit code 2, no traceback: checked before any rank starts
where it can be (then no run directory is made), and otherwise reported once by the launcher for the ranks."""
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import free_port, run_cli

QUICK = ["train.max_steps=2", "train.eval_iters=1", "train.eval_interval=0"]
SMALL = "data.max_bytes=300000"  # of the default data, the standard library's text


def one_error_line(result, starts: str) -> str:
    """The run failed with exit code 2 and exactly one stderr line, which starts with ``starts``."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {starts}"), lines
    return lines[0]


def fake_checkpoint(folder: Path, tag: str = "global_step2", latest: str | None = None) -> Path:
    """A checkpoint folder in DeepSpeed's layout holding one small model states file; returns that file."""
    (folder / tag).mkdir(parents=True)
    path = folder / tag / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(64, 64)}, "global_steps": 2}, path)
    (folder / "latest").write_text(latest or tag)
    return path


def corrupt_the_pickle(path: Path) -> None:
    """Overwrite the start of the file's pickled index (data.pkl): the zip directory stays whole, so only
    reading the file finds the damage."""
    import struct

    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len  # the local header's lengths (torch pads its extra)
    data[start:start + 20] = b"\xff" * 20  # from the first opcode on: no unpickler gets past it
    path.write_bytes(bytes(data))


def train(tmp_path: Path, *overrides: str, timeout: float = 300):
    return run_cli("train", *QUICK, f"launcher.master_port={free_port()}", *overrides, cwd=tmp_path, timeout=timeout)


def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(3000, dtype=np.int64) % 1000)  # ids up to 999; the default model has 256
    return path


# (case, overrides given tmp_path, expected start of the error line)
BEFORE_LAUNCH = [
    ("data.path left unset", lambda t: ["data=text"], "data.path: has no value"),
    ("a ??? left unset", lambda t: [SMALL, "model.n_layer=???"], "model.n_layer: has no value"),
    ("data.path that does not exist", lambda t: ["data=text", f"data.path={t / 'none.txt'}"], "data.path: "),
    ("train.resume that does not exist", lambda t: [SMALL, f"train.resume={t / 'nothing'}"],
     "train.resume: no checkpoint"),
    ("n_head does not divide n_embd", lambda t: [SMALL, "model.n_head=5"],
     "model.n_embd: 96 is not divisible by n_head=5"),
    ("seq_len above block_size", lambda t: [SMALL, "data.seq_len=256"], "data.seq_len: 256 exceeds model.block_size=128"),
    ("vocabulary smaller than the token file's", lambda t: ["data=tokens", f"data.path={_token_file(t)}"],
     "model.vocab_size: 256 is smaller than the data's vocabulary (1000"),
    ("a truncated .npy token file", lambda t: ["data=tokens", f"data.path={_truncated(_token_file(t))}"],
     "data.path: "),
    ("experts that ep_size does not divide", lambda t: [SMALL, "+recipe=gpt_moe", "model.moe.num_experts=3"],
     "model.moe.num_experts: 3 experts cannot be spread evenly over model.moe.ep_size=2 ranks"),
    ("more pipeline stages than layers", lambda t: [SMALL, "+recipe=gpt_pipe", "model.pipeline_stages=8",
                                                    "model.n_layer=1", "launcher.num_procs=8"],
     "model.pipeline_stages: 8 stages but a GPT of n_layer=1 is 5 pipeline layers"),
]


def _truncated(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    return path


@pytest.mark.parametrize("case,overrides,expected", BEFORE_LAUNCH, ids=[c[0] for c in BEFORE_LAUNCH])
def test_mistakes_found_before_launch(tmp_path, case, overrides, expected):
    one_error_line(train(tmp_path, *overrides(tmp_path)), expected)
    assert not (tmp_path / "outputs").exists()  # caught before Hydra made a run directory


def test_dry_run_refuses_what_a_launch_refuses(tmp_path):
    """``--dry-run`` runs the same checks: the MoE layout it used to pass with a note is one line, exit 2."""
    result = run_cli("train", "--dry-run", SMALL, "+recipe=gpt_moe", "model.moe.num_experts=3", cwd=tmp_path)
    one_error_line(result, "model.moe.num_experts: 3 experts")
    assert "dry run" not in result.stdout


def test_a_truncated_checkpoint_is_found_before_launch(tmp_path):
    path = fake_checkpoint(tmp_path / "ckpt")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    line = one_error_line(train(tmp_path, SMALL, f"train.resume={tmp_path / 'ckpt'}"), "train.resume: ")
    assert f"{path} is not a whole checkpoint file (it is truncated or not a torch file)" in line


def test_latest_naming_a_missing_tag_is_found_before_launch(tmp_path):
    fake_checkpoint(tmp_path / "ckpt", latest="global_step9")
    line = one_error_line(train(tmp_path, SMALL, f"train.resume={tmp_path / 'ckpt'}"), "train.resume: ")
    assert "names tag 'global_step9'" in line and "tags there: global_step2" in line


@pytest.mark.slow
def test_a_corrupt_checkpoint_found_by_the_ranks_is_one_line(tmp_path):
    path = fake_checkpoint(tmp_path / "ckpt")
    corrupt_the_pickle(path)  # the zip directory is whole: only a rank reading it finds the damage
    result = train(tmp_path, SMALL, f"train.resume={tmp_path / 'ckpt'}")
    line = one_error_line(result, f"{path}: cannot read this checkpoint file: its contents are corrupt")
    assert "[dsrun] run directory" in result.stdout  # it did launch
    (log,) = tmp_path.glob("outputs/*/*/dsrun.log")
    assert line in log.read_text()


@pytest.mark.slow
def test_an_optimizer_param_the_ranks_reject_is_one_line_and_debug_shows_the_traceback(tmp_path):
    result = train(tmp_path, SMALL, "+optimizer.params.lrr=1")
    one_error_line(result, "optimizer.params: AdamW rejected the params")
    assert "unexpected keyword argument 'lrr'" in result.stderr
    debug = run_cli("--debug", "train", *QUICK, SMALL, f"launcher.master_port={free_port()}", "+optimizer.params.lrr=1",
                    cwd=tmp_path, timeout=300)
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_convert_names_a_damaged_checkpoint_file(tmp_path, damage):
    path = fake_checkpoint(tmp_path / "ckpt")
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    else:
        corrupt_the_pickle(path)
    result = run_cli("convert", "zero-to-fp32", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), cwd=tmp_path)
    line = one_error_line(result, f"{tmp_path / 'ckpt'}: {path}: cannot read this checkpoint file: ")
    assert line.split("file: ", 1)[1].startswith("it is truncated" if damage == "truncate" else "its contents")


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_staging_folder(tmp_path):
    """A run whose checkpoint does not fit its disk (a real 3 MiB tmpfs holding the run directory and the
    MLflow store; the checkpoint takes ~6 MB) ends with one line naming the tag and the bytes, exit code 2:
    no MLflow/SQLAlchemy text, no staging folder left, and the ranks' logs hold the cause."""
    from tests.helpers import small_disk

    with small_disk(tmp_path / "disk", "3m") as disk:
        result = train(disk, SMALL, "train.save_interval=2")
        line = one_error_line(result, "save_checkpoint: no space left on device while saving global_step2 in ")
        assert " bytes needed, " in line and " free); nothing of it was kept" in line
        assert not any(word in (result.stdout + result.stderr).lower() for word in ("sqlalchemy", "sqlite", "mlflow."))
        (run_dir,) = disk.glob("outputs/*/*")
        assert list((run_dir / "checkpoints").iterdir()) == []
        assert "no space left on device while saving global_step2" in (run_dir / "logs" / "rank1.stderr.log").read_text()


def _finished_run(root: Path, overrides: list[str], step: int) -> Path:
    """A run directory as `dsrun train` leaves it, as far as train.resume=auto reads it: Hydra's record of the
    overrides and a checkpoint at ``step``."""
    run_dir = root / "outputs" / "2026-01-01" / "10-00-00"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    fake_checkpoint(run_dir / "checkpoints", f"global_step{step}")
    return run_dir


def test_auto_on_a_finished_run_says_so_in_one_line_and_launches_nothing(tmp_path):
    done = _finished_run(tmp_path, ["+recipe=default", SMALL], 2)
    result = train(tmp_path, SMALL, "train.resume=auto")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr == "" and "[rank" not in result.stdout and "run directory" not in result.stdout
    assert (f"[dsrun] train.resume=auto: the newest run with the same recipe and overrides, {done}, finished: its "
            "checkpoint global_step2 is at step 2 of train.max_steps=2; nothing to train (raise train.max_steps to "
            "train it longer, e.g. train.max_steps=4)") in result.stdout.splitlines()
    assert not list(tmp_path.glob("outputs/*/*/logs"))  # no rank was started


def test_from_a_run_whose_latest_is_damaged_is_one_line_naming_the_newest_complete_tag(tmp_path):
    assert run_cli("train", "--dry-run", *QUICK, SMALL, cwd=tmp_path, timeout=300).returncode == 0
    (source,) = tmp_path.glob("outputs/*/*")  # a run directory with dsrun's record of its composition
    fake_checkpoint(source / "checkpoints", "global_step1", latest="global_step9")
    result = run_cli("train", "--from", str(source), cwd=tmp_path, timeout=300)
    line = one_error_line(result, f"--from: {source / 'checkpoints' / 'latest'} names tag 'global_step9', but ")
    assert line.endswith(f"(complete tags there: global_step1) (resume from the newest complete one: "
                         f"dsrun train --from {source} train.resume={source / 'checkpoints' / 'global_step1'}, or "
                         f"write an existing tag into {source / 'checkpoints' / 'latest'})")
    assert list(tmp_path.glob("outputs/*/*")) == [source]  # refused before Hydra made a run directory
