"""Quality and compute of each data-efficiency technique on the GPT recipe, against the plain run.

Each variant is a real ``dsrun train +recipe=gpt_data_efficiency data_efficiency=NAME`` launch (same seed, data,
steps and LR schedule; ``none`` is the baseline), run one after the other. From each run's ``metrics.json``:
the final eval loss, the tokens and layer-tokens trained (measured in the model: after curriculum truncation,
random-LTD's kept tokens and skipped layers), the fraction of layer calls executed, and the tokens at which the
eval loss first reaches the baseline's final eval loss (interpolated between evaluations; "not reached" when
it never does). For progressive layer drop, the executed-layer fraction is compared with its expectation
under θ(t). Wall-clock ratios are against the baseline measured in the same invocation; the load average is
printed with them.

    python benchmarks/data_efficiency.py [--steps 400] [--eval-interval 25] [--variants none,pld,...]
                                         [--procs 2] [--json out.json] [--direct] [overrides ...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VARIANTS = ("none", "curriculum_seqlen", "sampling_seqlen", "sampling_rarity", "random_ltd", "pld", "all")


def _ranks_directly(run_dir: Path, procs: int, env: dict) -> subprocess.CompletedProcess:
    """The ranks of a ``--dry-run`` run directory as plain processes (no launcher agent)."""
    from dsrun.utils.net import free_port

    port, threads = free_port(), max(1, (os.cpu_count() or 1) // procs)
    ranks = [subprocess.Popen([sys.executable, "-m", "dsrun.worker", "--run-dir", str(run_dir)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(procs),
                                   "LOCAL_WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)})
             for r in range(procs)]
    outputs = [rank.communicate()[0] for rank in ranks]
    code = max(rank.returncode for rank in ranks)
    return subprocess.CompletedProcess(ranks[0].args, code, "".join(outputs), "")


def run_variant(name: str, steps: int, eval_interval: int, procs: int, workdir: Path, extra: list[str],
                direct: bool = False) -> dict:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "dsrun", "train", "+recipe=gpt_data_efficiency", f"data_efficiency={name}",
           f"train.max_steps={steps}", f"train.eval_interval={eval_interval}", "train.save_interval=0",
           f"launcher.num_procs={procs}", "monitor=csv", f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "DSRUN_MLFLOW": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    started = time.perf_counter()
    done = subprocess.run(cmd + (["--dry-run"] if direct else []), env=env, text=True, capture_output=True)
    if direct and not done.returncode:
        done = _ranks_directly(run_dir, procs, env)
    if done.returncode:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["launch_seconds"] = time.perf_counter() - started
    return metrics


def tokens_to_reach(curve: list[dict], target: float) -> float | None:
    """Tokens at which the eval loss first reaches ``target`` (linear between evaluations)."""
    for before, after in zip(curve, curve[1:]):
        if after["loss"] <= target:
            if before["loss"] <= target:
                return float(before["tokens"])
            share = (before["loss"] - target) / (before["loss"] - after["loss"])
            return before["tokens"] + share * (after["tokens"] - before["tokens"])
    return None


def pld_expected_fraction(steps: int, theta: float, gamma: float, layers: int) -> float:
    """Mean over the run of the expected kept fraction 1 - (L+1)/(2L)(1 - θ): step k trains with θ(k - 1)
    (θ = 1 during the first step), as the engine updates it at each step boundary."""
    thetas = [1.0] + [(1 - theta) * math.exp(-gamma * (k - 1)) + theta for k in range(2, steps + 1)]
    return sum(1 - (layers + 1) / (2 * layers) * (1 - t) for t in thetas) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("outputs/bench_data_efficiency"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--direct", action="store_true",
                        help="start the ranks as plain processes instead of through dsrun's launcher")
    parser.add_argument("overrides", nargs="*", help="more dsrun overrides for every variant")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    if names[0] != "none":
        names = ["none", *[n for n in names if n != "none"]]
    results = {}
    for name in names:
        results[name] = run_variant(name, args.steps, args.eval_interval, args.procs, args.workdir, args.overrides,
                                    args.direct)
        print(f"[bench] {name}: final eval {results[name]['final_eval_loss']:.4f} "
              f"in {results[name]['wall_time_s']:.1f}s", flush=True)
    load = os.getloadavg()
    base = results["none"]
    base_final, base_last = base["final_eval_loss"], base["eval_losses"][-1]
    rows = []
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} cores; "
          f"{args.steps} steps, {args.procs} ranks, baseline final eval loss {base_final:.4f}")
    print(f"{'variant':18} {'eval loss':>9} {'vs base':>8} {'tokens':>7} {'layer-tok':>9} {'layers run':>10} "
          f"{'tok to base':>11} {'wall':>6}")
    for name, m in results.items():
        last = m["eval_losses"][-1]
        reach = tokens_to_reach(m["eval_losses"], base_final)
        row = {"variant": name, "final_eval_loss": m["final_eval_loss"],
               "loss_ratio": m["final_eval_loss"] / base_final,
               "tokens_ratio": last["tokens"] / base_last["tokens"],
               "layer_tokens_ratio": last["layer_tokens"] / base_last["layer_tokens"],
               "layers_executed_fraction": last["layers_executed_fraction"],
               "tokens_to_baseline_loss_ratio": None if reach is None else reach / base_last["tokens"],
               "wall_ratio": m["wall_time_s"] / base["wall_time_s"], "wall_time_s": m["wall_time_s"],
               "random_ltd_consumed_layer_tokens": m.get("random_ltd_consumed_layer_tokens")}
        if name == "pld":
            ds = json.loads((args.workdir / name / "ds_config.json").read_text())["progressive_layer_drop"]
            layers = yaml.safe_load((args.workdir / name / "resolved.yaml").read_text())["model"]["n_layer"]
            row["pld_expected_fraction"] = pld_expected_fraction(args.steps, ds["theta"], ds["gamma"], layers)
        rows.append(row)
        reach_text = "not reached" if reach is None else f"{row['tokens_to_baseline_loss_ratio']:.3f}"
        print(f"{name:18} {row['final_eval_loss']:9.4f} {row['loss_ratio']:8.3f} {row['tokens_ratio']:7.3f} "
              f"{row['layer_tokens_ratio']:9.3f} {row['layers_executed_fraction']:10.3f} {reach_text:>11} "
              f"{row['wall_ratio']:6.2f}")
        if "pld_expected_fraction" in row:
            print(f"{'':18} PLD executed-layer fraction {row['layers_executed_fraction']:.4f} vs expected "
                  f"{row['pld_expected_fraction']:.4f} ({row['layers_executed_fraction'] / row['pld_expected_fraction'] - 1:+.2%})")
    if args.json:
        args.json.write_text(json.dumps({"load_average": load, "steps": args.steps, "procs": args.procs,
                                         "rows": rows, "curves": {n: m["eval_losses"] for n, m in results.items()}},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
