"""A regular (non-editable) install finds conf/ and recipes/ and runs from any directory."""
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.helpers import REPO


def make_venv(env_dir) -> str:
    """A virtual environment that sees the packages of the interpreter running the tests, and returns its
    python. ``system_site_packages=True`` would not do: it sees the *base* interpreter's packages, and inside
    a virtual environment the test dependencies live in that environment, not in its base. So the new
    environment gets a .pth file that adds this interpreter's site-packages folders as site directories
    (their own .pth files included), after its own, so what is installed into it wins."""
    import site

    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    ours = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    ours += [p for p in [site.getusersitepackages()] if os.path.isdir(p) and p not in ours]
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in ours)
    (Path(own) / "_dsrun_test_outer_site.pth").write_text(lines)
    return python


def source_copy(tmp_path) -> Path:
    """The repository's sources as a fresh clone has them, in the test's own folder: a build writes build/ and
    dsrun.egg-info/ beside the sources, and two tests building in the repository itself would share them."""
    ignored = [line.strip().strip("/") for line in (REPO / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    return Path(shutil.copytree(REPO, tmp_path / "source", ignore=shutil.ignore_patterns(".git", *ignored)))


def build_wheel(tmp_path) -> str:
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(source_copy(tmp_path))], check=True, timeout=240, cwd=tmp_path,
                   env={**os.environ, "DSRUN_BUILD_OPS": "0"})
    (wheel,) = wheel_dir.glob("dsrun-*.whl")
    return str(wheel)


@pytest.mark.slow
def test_wheel_install_composes_recipes(tmp_path):
    wheel = build_wheel(tmp_path)
    env_dir = tmp_path / "venv"
    python = make_venv(env_dir)
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a dev PYTHONPATH may show a dsrun
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, timeout=240, env=plain)                     # that makes pip skip the install
    work = tmp_path / "elsewhere"
    work.mkdir()
    result = subprocess.run([str(env_dir / "bin" / "dsrun"), "config", "--json", "+recipe=gpt_zero3"],
                            cwd=work, capture_output=True, text=True, timeout=120, env=plain)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["zero_optimization"]["stage"] == 3
    where = subprocess.run([str(python), "-c", "import dsrun.utils.paths as p; print(p.conf_dir())"],
                           cwd=work, capture_output=True, text=True, timeout=60, env=plain)
    assert str(env_dir) in where.stdout, where.stdout + where.stderr


# Which sweepers Hydra knows, and where the Optuna sweeper's code comes from: after a plain Hydra plugin scan
# (what any Hydra app does) and after dsrun's own registration (what dsrun train -m does).
SWEEPERS = """
import sys
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
found = {p.__module__: sys.modules[p.__module__].__file__ for p in Plugins.instance().discover(Sweeper)}
if sys.argv[1] == "dsrun":
    from hydra_plugins.dsrun_optuna_sweeper import register_with_hydra
    register_with_hydra()
    found = {p.__module__: sys.modules[p.__module__].__file__ for p in Plugins.instance().discover(Sweeper)}
print(found.get("hydra_plugins.dsrun_optuna_sweeper.optuna_sweeper", "missing"))
"""


@pytest.mark.slow
def test_the_optuna_sweeper_plugin_is_found_after_a_wheel_and_an_editable_install(tmp_path):
    wheel = build_wheel(tmp_path)
    source = tmp_path / "source"  # the copy build_wheel built from: an editable install writes beside it too
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the install put in place
    for kind, target in (("wheel", [wheel]), ("editable", ["-e", str(source)])):
        env_dir = tmp_path / kind
        python = make_venv(env_dir)
        subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation", "-q",
                        *target], check=True, timeout=240, env={**env, "DSRUN_BUILD_OPS": "0"})
        where = tmp_path / "elsewhere"
        where.mkdir(exist_ok=True)
        # a wheel puts hydra_plugins/ in site-packages, where Hydra's own scan finds it; an editable install
        # serves it through an import hook that the scan cannot list, so dsrun registers it itself
        for how in ("dsrun",) if kind == "editable" else ("scan", "dsrun"):
            done = subprocess.run([python, "-c", SWEEPERS, how], cwd=where, env=env, capture_output=True,
                                  text=True, timeout=120)
            expected = env_dir if kind == "wheel" else source
            assert done.returncode == 0 and done.stdout.strip().startswith(str(expected)), (kind, how, done.stdout,
                                                                                            done.stderr[-2000:])
