"""`dsrun config`, `dsrun train --dry-run` and `dsrun recipes` as a user runs them."""
import json
from pathlib import Path

from tests.helpers import first_output_probe, run_cli


def test_help_lists_subcommands():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in ("train", "config", "recipes"):
        assert name in result.stdout


def test_subcommand_help():
    result = run_cli("config", "--help")
    assert result.returncode == 0 and "--validate" in result.stdout and "--json" in result.stdout


def test_unknown_subcommand_suggests():
    result = run_cli("confgi")
    assert result.returncode == 2
    assert "did you mean 'config'?" in result.stderr


def test_config_json_for_zero3_is_consistent_and_validates(tmp_path):
    result = run_cli("config", "--json", "+recipe=gpt_zero3")
    assert result.returncode == 0, result.stderr
    ds = json.loads(result.stdout)  # stdout is the JSON and nothing else
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    path = tmp_path / "ds.json"
    path.write_text(result.stdout)
    check = run_cli("config", "--validate", str(path), "--world-size", "2")
    assert check.returncode == 0 and check.stdout.strip() == "valid", check.stderr


def test_config_yaml_shows_the_runspec():
    result = run_cli("config", "+recipe=gpt_zero1", "train.max_steps=9")
    assert result.returncode == 0, result.stderr
    assert "max_steps: 9" in result.stdout and "stage: 1" in result.stdout


def test_validate_reports_every_problem_with_exit_2(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 5, "overlap_com": True},
                                "fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    result = run_cli("config", "--validate", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 3 and all(line.startswith("error: ") for line in lines)
    assert any("zero_optimization.stage" in line for line in lines)
    assert any("zero_optimization.overlap_com" in line and "overlap_comm" in line for line in lines)
    assert "Traceback" not in result.stderr


def test_validate_missing_file(tmp_path):
    result = run_cli("config", "--validate", str(tmp_path / "nope.json"))
    assert result.returncode == 2 and "nope.json" in result.stderr and "Traceback" not in result.stderr


def test_user_error_is_one_line_exit_2_and_debug_shows_traceback():
    result = run_cli("config", "+recipe=nope")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "unknown recipe 'nope'" in result.stderr
    debug = run_cli("--debug", "config", "+recipe=nope")
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    env = run_cli("config", "+recipe=nope", env={"HYDRA_FULL_ERROR": "1"})
    assert "Traceback" in env.stderr


def test_train_dry_run_writes_a_valid_run_directory(tmp_path):
    result = run_cli("train", "--dry-run", "+recipe=gpt_zero3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "dry run: nothing launched" in result.stdout
    run_dirs = [p.parent for p in tmp_path.glob("outputs/*/*/ds_config.json")]
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    assert (run_dir / "resolved.yaml").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    check = run_cli("config", "--validate", str(run_dir / "ds_config.json"), "--world-size", "2")
    assert check.returncode == 0 and check.stdout.strip() == "valid", check.stderr


def test_train_dry_run_bad_override_creates_no_run_dir(tmp_path):
    result = run_cli("train", "--dry-run", "ds.zero_optimization.stage=9", cwd=tmp_path)
    assert result.returncode == 2 and "ds.zero_optimization.stage" in result.stderr
    assert not (tmp_path / "outputs").exists()


def test_train_dry_run_with_deepspeed_json(tmp_path):
    ds_file = Path(tmp_path) / "my_ds.json"
    ds_file.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                                   "zero_optimization": {"stage": 1}, "gradient_clipping": 0.3}))
    result = run_cli("train", "--dry-run", f"ds_config={ds_file}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (written,) = tmp_path.glob("outputs/*/*/ds_config.json")
    ds = json.loads(written.read_text())
    assert ds["train_batch_size"] == 12 and ds["gradient_clipping"] == 0.3
    assert ds["zero_optimization"]["stage"] == 1


def test_train_says_what_it_does_before_the_heavy_work(tmp_path):
    """20-45 s passed on a busy machine before dsrun train printed anything: Hydra's composition, torch (for
    the meta-device model and the memory estimate), the data and the estimate all ran first, silently. Now
    the first line comes before any of those modules is imported, and each stage is announced in order."""
    seen, result = first_output_probe("train", "--dry-run", "data.max_bytes=300000", cwd=tmp_path)
    assert seen["code"] == 0, result.stderr
    assert seen["line"] == "[dsrun] composing the config (Hydra)" and seen["loaded"] == [], seen
    stages = [line for line in result.stdout.splitlines() if line.startswith("[dsrun] ")]
    assert [line.split(":")[0].split(" (")[0] for line in stages] == ["[dsrun] composing the config",
                                                                      "[dsrun] checking before launch"], stages
    assert result.stderr == "" and result.stdout.rsplit("@@", 1)[0].rstrip().endswith("dry run: nothing launched")


def test_recipes_lists_each_with_description():
    result = run_cli("recipes")
    assert result.returncode == 0
    assert "gpt_zero3" in result.stdout and "ZeRO-3" in result.stdout


def test_recipes_prints_every_built_in_description_whole_on_a_narrow_terminal():
    """Descriptions were cut at the end of the recipe's first comment line ("... attention", "an eighth of
    the"): each is now the whole first sentence of the comment block, and the table wraps it, dropping nothing."""
    import re

    from dsrun.compose import list_recipes
    from dsrun.utils.paths import recipes_dir

    result = run_cli("recipes", env={"COLUMNS": "60"})
    assert result.returncode == 0, result.stderr
    printed = re.sub(r"[\s│┃]", "", result.stdout)  # the table's rows, unwrapped (continuation rows have no name)
    built_in = {name: text for name, (path, text) in list_recipes().items() if path.parent == recipes_dir()}
    assert len(built_in) >= 20
    for name, text in built_in.items():
        comment = " ".join(line.lstrip("#").strip() for line in (recipes_dir() / f"{name}.yaml").read_text()
                           .splitlines() if line.startswith("#") and "@package" not in line)
        assert text.endswith((".", "!", "?")) and comment.startswith(text), (name, text)
        assert re.sub(r"\s", "", name + text) in printed, (name, text)
    assert max(len(line) for line in result.stdout.splitlines()) <= 60


def test_multirun_dry_run_makes_one_directory_per_job(tmp_path):
    result = run_cli("train", "--dry-run", "-m", "zero=stage1,stage2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    stages = sorted(json.loads(p.read_text())["zero_optimization"]["stage"]
                    for p in tmp_path.glob("multirun/*/*/*/ds_config.json"))
    assert stages == [1, 2]


def test_a_migrated_legacy_key_is_reported_once(tmp_path):
    """The note used to come three times from a dry run (the dsrun.config logger, its LegacyConfigWarning with
    a source line, and again from the second composition inside Hydra's job)."""
    note = "ds.zero_optimization.cpu_offload: deprecated, migrated to ds.zero_optimization.offload_optimizer"
    for args in (["config"], ["train", "--dry-run", "data.max_bytes=300000"]):
        result = run_cli(*args, "zero=stage2", "+ds.zero_optimization.cpu_offload=true", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert (result.stdout + result.stderr).count(note) == 1, result.stderr
        assert "LegacyConfigWarning" not in result.stderr
