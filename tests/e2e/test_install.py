"""A regular (non-editable) install finds conf/ and recipes/ and runs from any directory."""
import json
import os
import subprocess
import sys
import venv

import pytest

from tests.helpers import REPO


@pytest.mark.slow
def test_wheel_install_composes_recipes(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(REPO)], check=True, timeout=240, cwd=tmp_path,
                   env={**os.environ, "DSRUN_BUILD_OPS": "0"})
    (wheel,) = wheel_dir.glob("dsrun-*.whl")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, timeout=240)
    work = tmp_path / "elsewhere"
    work.mkdir()
    result = subprocess.run([str(env_dir / "bin" / "dsrun"), "config", "--json", "+recipe=gpt_zero3"],
                            cwd=work, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["zero_optimization"]["stage"] == 3
    where = subprocess.run([str(python), "-c", "import dsrun.utils.paths as p; print(p.conf_dir())"],
                           cwd=work, capture_output=True, text=True, timeout=60)
    assert str(env_dir) in where.stdout, where.stdout + where.stderr
