"""Train the gpt_sparse recipe and the same recipe with dense attention; compare their loss curves.

    PYTHONPATH=. python benchmarks/sparse_gpt.py [--steps 300] [--out benchmarks/sparse_gpt_results.json] [OVERRIDES]

Both runs are real ``dsrun train`` launches (2 CPU ranks by default) with the same seed, data and batch
order; the dense one is ``+recipe=gpt_sparse attention=dense ~ds.sparse_attention``. Extra arguments are
passed to both as overrides. Printed: eval loss at every evaluation for each, the final train losses
(mean of the last 20 steps), tokens/s, and the load average before and after (the machine may be shared:
throughput is only comparable between runs taken at similar load). The curves go to ``--out`` as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "sparse": ["+recipe=gpt_sparse"],
    "dense": ["+recipe=gpt_sparse", "attention=dense", "~ds.sparse_attention"],
}


def train(overrides: list[str], workdir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSRUN_MLFLOW": "false"}
    result = subprocess.run([sys.executable, "-m", "dsrun", "train", *overrides], cwd=workdir, env=env, text=True,
                            capture_output=True, timeout=7200)
    if result.returncode:
        raise SystemExit(f"dsrun train {' '.join(overrides)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    (metrics,) = workdir.glob("outputs/*/*/metrics.json")
    return json.loads(metrics.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "sparse_gpt_results.json")
    args, extra = parser.parse_known_args()
    common = [f"train.max_steps={args.steps}", "train.eval_interval=50", "train.save_interval=0", "monitor=csv",
              *extra]
    results = {"load_average_before": os.getloadavg(), "overrides": common, "runs": {}}
    for name, overrides in VARIANTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            metrics = train(overrides + common, Path(tmp))
        results["runs"][name] = {key: metrics[key] for key in ("train_losses", "eval_losses", "tokens_per_second",
                                                                "wall_time_s", "num_params", "tokens_per_step")}
        print(f"{name}: {metrics['tokens_per_second']:,.0f} tokens/s, {metrics['wall_time_s']:.0f} s", flush=True)
    results["load_average_after"] = os.getloadavg()
    runs = results["runs"]
    print(f"\nload average {results['load_average_before'][0]:.1f} before, {results['load_average_after'][0]:.1f} after")
    print(f"{'step':>6} {'dense eval':>11} {'sparse eval':>12}")
    for dense, sparse in zip(runs["dense"]["eval_losses"], runs["sparse"]["eval_losses"]):
        print(f"{dense['step']:>6} {dense['loss']:>11.4f} {sparse['loss']:>12.4f}")
    for name, run in runs.items():
        tail = run["train_losses"][-20:]
        print(f"{name}: mean train loss of the last {len(tail)} steps {sum(tail) / len(tail):.4f}")
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"curves: {args.out}")


if __name__ == "__main__":
    main()
