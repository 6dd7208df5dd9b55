"""The model-based tuner against the exhaustive grid, on one search space, in one run.

Both are real ``dsrun tune`` studies over the same recipe and space (default: ``gpt_tune``, ZeRO stage 0-3 x
micro batch 1, 2, 4, 8 = 16 configurations, 2 ranks): first ``tuner_type=gridsearch`` over every
configuration, then ``tuner_type=model_based`` (Optuna's TPE) with at most half as many trials. Every trial
is a real ``dsrun train`` launch measured by the engine's timers over the profile window.

Two ratios are reported, because the two studies run at different moments of a shared machine:

* ``tuner best / grid best``: each study's best throughput as it measured it;
* ``grid-measured pick / grid best``: the throughput the *grid* measured for the configuration the tuner
  picked, which compares the choice with no time between the two measurements.

    python benchmarks/autotune_vs_grid.py [--fraction 0.5] [--work DIR] [--json out.json] [OVERRIDE ...]

Target (issue 10): tuner >= 95% of the grid's best with <= 50% of the trials.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ["+recipe=gpt_tune", "autotuning.start_profile_step=3", "autotuning.end_profile_step=10",
           "+ds.autotuning.model_info.num_params=120576", "autotuning.tuner_early_stopping=100"]


def tune(work: Path, name: str, overrides: list[str], tuner: str, trials: int) -> tuple[list, float]:
    import optuna

    results = work / name
    command = [sys.executable, "-m", "dsrun", "tune", *overrides, f"autotuning.tuner_type={tuner}",
               f"autotuning.tuner_num_trials={trials}", f"++ds.autotuning.results_dir={results}",
               f"++ds.autotuning.exps_dir={work / (name + '_exps')}", "autotuning.overwrite=true"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(study_name="dsrun-tune", storage=f"sqlite:///{results / 'study.db'}")
    return [t for t in study.trials if t.user_attrs.get("kind") in ("launched", "pruned")], elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fraction", type=float, default=0.5, help="tuner trials / grid trials (default 0.5)")
    parser.add_argument("--work", type=Path, default=None, help="where the studies go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    parser.add_argument("overrides", nargs="*", help="dsrun overrides (default: the gpt_tune recipe)")
    args = parser.parse_args()
    overrides = args.overrides or DEFAULT
    work = args.work or Path(tempfile.mkdtemp(prefix="autotune-vs-grid-"))
    work.mkdir(parents=True, exist_ok=True)

    grid, grid_s = tune(work, "grid", overrides, "gridsearch", 10_000)
    size = len(grid)
    budget = max(1, int(size * args.fraction))
    tpe, tpe_s = tune(work, "model_based", overrides, "model_based", budget)

    measured = {t.user_attrs["exp_name"]: t.value for t in grid if t.value is not None}
    grid_best = max((t for t in grid if t.value is not None), key=lambda t: t.value)
    tpe_best = max((t for t in tpe if t.value is not None), key=lambda t: t.value)
    pick_in_grid = measured.get(tpe_best.user_attrs["exp_name"])

    print(f"\nsearch space: {size} configurations; model_based budget: {budget} trials ({args.fraction:.0%})")
    print(f"{'configuration':<22} {'grid samples/s':>15} {'model_based samples/s':>22}")
    tpe_values = {t.user_attrs.get("exp_name"): t.value for t in tpe}
    for t in sorted(grid, key=lambda t: (t.user_attrs["exp_name"])):
        name = t.user_attrs["exp_name"]
        g = f"{t.value:.1f}" if t.value is not None else t.state.name.lower()
        m = tpe_values.get(name, None)
        m = "-" if name not in tpe_values else (f"{m:.1f}" if m is not None else "pruned/failed")
        print(f"{name:<22} {g:>15} {m:>22}")
    print()
    rows = [("grid (gridsearch)", len(grid), grid_best.user_attrs["exp_name"], grid_best.value, grid_s),
            ("tuner (model_based)", len(tpe), tpe_best.user_attrs["exp_name"], tpe_best.value, tpe_s)]
    print(f"{'study':<22} {'trials':>6} {'best configuration':<20} {'best samples/s':>15} {'wall s':>8}")
    for study, n, name, value, seconds in rows:
        print(f"{study:<22} {n:>6} {name:<20} {value:>15.1f} {seconds:>8.0f}")
    ratio = tpe_best.value / grid_best.value
    pick_ratio = pick_in_grid / grid_best.value if pick_in_grid else None
    print(f"\ntuner best / grid best = {ratio:.3f} with {len(tpe)}/{len(grid)} trials "
          f"({len(tpe) / len(grid):.0%}); target >= 0.95 with <= 50%")
    if pick_ratio is not None:
        print(f"grid-measured throughput of the tuner's pick / grid best = {pick_ratio:.3f}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; studies in {work}")
    if args.json:
        args.json.write_text(json.dumps({
            "space_size": size, "grid": {"trials": len(grid), "best": grid_best.value,
                                         "best_exp": grid_best.user_attrs["exp_name"], "seconds": grid_s},
            "model_based": {"trials": len(tpe), "best": tpe_best.value, "best_exp": tpe_best.user_attrs["exp_name"],
                            "seconds": tpe_s},
            "ratio": ratio, "pick_ratio": pick_ratio, "load": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
