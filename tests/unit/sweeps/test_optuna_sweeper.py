"""dsrun's Optuna sweeper for Hydra: sweep syntax → Optuna distributions, and a real Hydra app's sweep."""
import subprocess
import sys
import textwrap

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from hydra_plugins.dsrun_optuna_sweeper.optuna_sweeper import distribution_for, override_text
from tests.helpers import REPO


@pytest.mark.parametrize("sweep, expected", [
    ("a,b,c", CategoricalDistribution(["a", "b", "c"])),
    ("choice(1, 2.5, true)", CategoricalDistribution([1, 2.5, True])),
    ("range(1, 9, step=2)", IntDistribution(1, 9, step=2)),  # stop included, as Optuna's high
    ("range(-5.5, 5.5, step=0.5)", FloatDistribution(-5.5, 5.5, step=0.5)),
    ("interval(0, 1)", FloatDistribution(0.0, 1.0)),
    ("int(interval(1, 64))", IntDistribution(1, 64)),
    ("tag(log, interval(1e-5, 1e-2))", FloatDistribution(1e-5, 1e-2, log=True)),
    ("tag(log, int(interval(1, 64)))", IntDistribution(1, 64, log=True)),
])
def test_sweep_syntax_maps_to_the_upstream_plugins_distributions(sweep, expected):
    (override,) = OverridesParser.create().parse_overrides([f"key={sweep}"])
    assert distribution_for(override) == expected


def test_values_go_back_as_overrides_hydra_reads_as_the_same_value():
    parser = OverridesParser.create()
    for value in ["stage1", "has space", "1e-4", "a,b", 0.0003, 7, True, None]:
        (override,) = parser.parse_overrides([override_text("k", value)])
        assert override.value() == value and not override.is_sweep_override(), value


APP = textwrap.dedent("""
    import hydra
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="cfg", node={"x": 0, "y": "a"})

    @hydra.main(version_base="1.3", config_path=None, config_name="cfg")
    def main(cfg):
        if cfg.x == 4:
            raise RuntimeError("x=4 crashes")
        return (cfg.x - 2) ** 2 + (0 if cfg.y == "a" else 10)

    main()
""")


def test_a_hydra_app_sweeps_the_grid_records_failures_and_writes_the_best(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    done = subprocess.run(
        [sys.executable, "app.py", "-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid",
         "hydra.sweeper.n_trials=50", "hydra.sweeper.n_jobs=3", "hydra.sweeper.max_failure_rate=0.2",
         "hydra.sweeper.storage=sqlite:///study.db", "hydra.sweeper.study_name=grid", "x=range(0,4)", "y=a,b",
         "hydra.sweep.dir=sweep"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    import optuna

    trials = optuna.load_study(study_name="grid", storage=f"sqlite:///{tmp_path / 'study.db'}").trials
    assert len(trials) == 10  # the whole 5 x 2 grid once, not n_trials=50
    assert sorted((t.params["x"], t.params["y"]) for t in trials) == [(x, y) for x in range(5) for y in "ab"]
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert sorted(t.params["y"] for t in failed) == ["a", "b"] and {t.params["x"] for t in failed} == {4}
    results = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"x": 2, "y": "a"} and results["best_value"] == 0
    assert (results["n_complete"], results["n_failed"]) == (8, 2)
