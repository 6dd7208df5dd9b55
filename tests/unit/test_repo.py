"""The repository keeps its promises to a new user: README commands, CI, top-level layout."""
import re

from tests.helpers import REPO


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_ci_runs_the_readme_test_command():
    test_command = next(c for c in readme_commands() if "pytest" in c)
    assert test_command in (REPO / ".ci" / "run").read_text()


def test_top_level_layout():
    for name in ["dsrun", "recipes", "csrc", "op_builder", "conf", "tests", "examples", "benchmarks",
                 "pyproject.toml", "README.md", ".ci/run"]:
        assert (REPO / name).exists(), name


def test_what_dsrun_writes_into_the_working_directory_is_ignored_by_git():
    """dsrun train / tune / MLflow write outputs/, multirun/, mlruns/ and dsrun tune's results and experiment
    folders (ds.autotuning.results_dir / exps_dir, by default relative to where it runs) into the current
    directory; none of it belongs in a commit."""
    from dsrun.config.misc import AutotuningConfig

    ignored = {line.strip().rstrip("/") for line in (REPO / ".gitignore").read_text().splitlines()}
    defaults = AutotuningConfig()
    for name in ("outputs", "multirun", "mlruns", defaults.results_dir, defaults.exps_dir):
        assert name in ignored, name
