"""DeepSpeed's commands run by dsrun (``dsrun alias install-bin DIR``): ``deepspeed`` launches an unedited
DeepSpeed script on dsrun's launcher with the user's arguments intact, ``ds_report`` prints dsrun's report,
``ds_elastic`` DeepSpeed's elasticity figures; a flag the launcher does not know is one line and exit 2. Real
processes throughout: the executables as a shell finds them on PATH."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO, run_cli

SCRIPT = """\
import argparse, json, os
import deepspeed
import dsrun
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--arg")
args = deepspeed.add_config_arguments(parser).parse_args()
deepspeed.init_distributed()
assert deepspeed.init_distributed is dsrun.init_distributed
print("RANK " + json.dumps({"rank": deepspeed.comm.get_rank(), "world": deepspeed.comm.get_world_size(),
      "local_rank": args.local_rank, "arg": args.arg, "deepspeed": args.deepspeed, "config": args.deepspeed_config}))
"""
ARG = """with spaces, 'single' and "double" quotes"""


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bin")
    result = run_cli("alias", "install-bin", str(folder))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(folder / name) for name in ("deepspeed", "ds_report", "ds_elastic")]
    return folder


def _command(bin_dir: Path, *argv: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(list(argv), cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_deepspeed_launches_two_ranks_with_the_users_arguments_intact(bin_dir, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 2}))
    result = _command(bin_dir, "deepspeed", "--num_gpus", "2", "train.py", "--deepspeed", "--deepspeed_config",
                      "ds.json", "--arg", ARG, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    ranks = sorted((json.loads(line.split("RANK ", 1)[1]) for line in result.stdout.splitlines() if "RANK {" in line),
                   key=lambda r: r["rank"])
    assert ranks == [{"rank": r, "world": 2, "local_rank": r, "arg": ARG, "deepspeed": True, "config": "ds.json"}
                     for r in (0, 1)]


def test_an_unknown_launcher_flag_is_one_line_and_exit_2(bin_dir, tmp_path):
    result = _command(bin_dir, "deepspeed", "--num_gpu", "2", "--bind_cores", "--master_prot", "29500", "train.py",
                      cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "deepspeed: error: unrecognized arguments: --master_prot (did you mean '--master_port'?); "
        "see deepspeed --help"]


def test_ds_report_prints_dsruns_report(bin_dir, tmp_path):
    result = _command(bin_dir, "ds_report", "--no-color", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "dsrun compiled ops" in result.stdout and "cpu_adam" in result.stdout
    assert any([cell.strip() for cell in line.split("│")][1:2] == ["dsrun"] for line in result.stdout.splitlines())
    hidden = _command(bin_dir, "ds_report", "--no-color", "--hide_operator_status", cwd=tmp_path)
    assert hidden.returncode == 0 and "compiled ops" not in hidden.stdout and "environment" in hidden.stdout


def test_ds_elastic_prints_the_batch_and_gpu_counts(bin_dir, tmp_path):
    config = {"train_batch_size": 8, "elasticity": {"enabled": True, "max_train_batch_size": 2000,
                                                    "micro_batch_sizes": [2, 4, 6], "min_gpus": 1, "max_gpus": 10000,
                                                    "min_time": 20, "version": 0.1}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    result = _command(bin_dir, "ds_elastic", "-c", "ds.json", "-w", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "final_batch_size .... 1680" in result.stdout and "micro_batch_size .... 6" in result.stdout


def test_python_m_dsrun_alias_puts_the_commands_on_its_childrens_path_only(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(textwrap.dedent("""\
        import shutil, subprocess
        found = shutil.which("deepspeed")
        print(found)
        print(subprocess.run(["deepspeed", "--help"], capture_output=True, text=True).stdout.splitlines()[0])
        """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "dsrun.alias", str(script)], env=env, text=True,
                            capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found, usage = result.stdout.splitlines()[:2]
    assert Path(found).name == "deepspeed" and Path(found).parent.name.startswith("dsrun-deepspeed-bin-")
    assert usage.startswith("usage: deepspeed ")
    assert not Path(found).parent.exists()  # the temporary folder went with the process
    assert shutil.which("deepspeed") is None  # nothing is installed by default


def test_launch_as_deepspeed_puts_the_commands_first_on_the_ranks_path(tmp_path):
    (tmp_path / "where.py").write_text("import shutil\nprint('FOUND', shutil.which('ds_elastic'))\n")
    result = run_cli("launch", "--as-deepspeed", "--num_procs", "1", "--no_local_rank", "where.py", cwd=tmp_path,
                     timeout=180)
    assert result.returncode == 0, result.stderr
    found = Path(result.stdout.split("FOUND ", 1)[1].split()[0])
    assert found.parent.name.startswith("dsrun-deepspeed-bin-") and not found.parent.exists()


def test_install_bin_refuses_to_shadow_a_real_deepspeed(tmp_path):
    (tmp_path / "site" / "deepspeed").mkdir(parents=True)
    (tmp_path / "site" / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    result = run_cli("alias", "install-bin", str(tmp_path / "bin"), env={"PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 2 and "a real DeepSpeed is installed" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "bin").exists()
