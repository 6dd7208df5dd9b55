"""The opt-in ``deepspeed`` alias: ``import deepspeed`` loads dsrun, reports DeepSpeed's API version so Hugging
Face's gates pass, and refuses to shadow a real DeepSpeed. Each case runs in a fresh interpreter, because the
alias changes the import system of the process that installs it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import REPO, run_cli

SITE = REPO / "dsrun" / "alias" / "site"


def _python(code: str, *args: str, pythonpath: list[Path] = (), cwd: Path | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in pythonpath] + [str(REPO)])
    return subprocess.run([sys.executable, *args, "-c", textwrap.dedent(code)] if code else [sys.executable, *args],
                          env=env, cwd=cwd, text=True, capture_output=True, timeout=timeout)


def _fake_real_deepspeed(root: Path) -> Path:
    package = root / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.19.8'\n")
    return root


def test_import_deepspeed_is_dsrun_with_the_api_version_hf_and_accelerate_accept():
    result = _python("""
        import importlib.metadata
        import dsrun.alias
        dsrun.alias.install()
        import deepspeed
        import deepspeed.runtime.lr_schedules
        from deepspeed.ops.op_builder import CPUAdamBuilder
        import dsrun, dsrun.optim.lr_schedules, op_builder
        assert deepspeed.__version__ == importlib.metadata.version("deepspeed") == dsrun.alias.DEEPSPEED_API_VERSION
        assert ".".join(map(str, (deepspeed.__version_major__, deepspeed.__version_minor__,
                                  deepspeed.__version_patch__))) == deepspeed.__version__
        assert deepspeed.initialize is dsrun.initialize and deepspeed.comm is dsrun.comm
        assert deepspeed.runtime.lr_schedules is dsrun.optim.lr_schedules
        assert deepspeed.runtime.engine is dsrun.engine.engine  # imported by `import deepspeed`, as in DeepSpeed
        assert CPUAdamBuilder is op_builder.CPUAdamBuilder
        from deepspeed.launcher import runner  # a renamed child, imported from its parent
        assert runner.parse_resource_filter({"w": [0, 1]}, exclude_str="w:1") == {"w": [0]}
        try:
            import deepspeed.no_such_module
        except ModuleNotFoundError as error:
            assert "deepspeed.no_such_module" in str(error)
        else:
            raise AssertionError("a missing submodule imported")
        from transformers.integrations.deepspeed import is_deepspeed_available
        from accelerate.utils import compare_versions, is_deepspeed_available as accelerate_has_deepspeed
        assert is_deepspeed_available() and accelerate_has_deepspeed()
        assert compare_versions("deepspeed", ">=", "0.9.3")  # accelerate's DeepSpeedPlugin gate
        print("version", deepspeed.__version__)
    """)
    assert result.returncode == 0, result.stderr
    assert "version 0.14.1" in result.stdout


def test_without_the_alias_there_is_no_deepspeed():
    result = _python("import importlib.util, dsrun; print(importlib.util.find_spec('deepspeed'))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_the_alias_refuses_to_shadow_a_real_deepspeed(tmp_path):
    real = _fake_real_deepspeed(tmp_path / "site-packages")
    installed = _python("""
        import dsrun.alias
        from dsrun.utils.errors import UserError
        try:
            dsrun.alias.install()
        except UserError as error:
            print("refused:", error)
    """, pythonpath=[real])
    assert "refused: deepspeed alias: a real DeepSpeed is installed" in installed.stdout, installed.stderr
    # the shim on PYTHONPATH (what `dsrun launch --as-deepspeed` sets) refuses at import time
    shim = _python("import deepspeed", pythonpath=[SITE, real])
    assert shim.returncode != 0
    assert "ImportError: deepspeed alias: a real DeepSpeed is installed" in shim.stderr


def test_python_m_dsrun_alias_runs_an_unedited_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys, deepspeed\nprint(deepspeed.__version__, sys.argv[1:], __name__)\n")
    result = _python("", "-m", "dsrun.alias", str(script), "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0.14.1 ['--lr', '0.1'] __main__"


def test_launch_as_deepspeed_gives_every_rank_the_alias(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os, deepspeed, dsrun\n"
                      "assert deepspeed.init_distributed is dsrun.init_distributed\n"
                      # one write per line: torch's tee prefixes each piece an unbuffered print(a, b) writes
                      "print(f\"rank {os.environ['RANK']} {deepspeed.__version__}\")\n")
    result = run_cli("launch", "--as-deepspeed", "--num_procs", "2", "--no_local_rank", str(script),
                     cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "rank 0 0.14.1" in result.stdout and "rank 1 0.14.1" in result.stdout
    plain = run_cli("launch", "--num_procs", "1", "--no_local_rank", str(script), cwd=tmp_path, timeout=240)
    assert plain.returncode != 0 and "No module named 'deepspeed'" in plain.stderr
