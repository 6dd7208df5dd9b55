"""How long a checkpoint save stops training, synchronous against decoupled (``checkpoint.writer.decoupled``).

Runs ``dsrun train`` twice as a user runs it, the same recipe (default: ``model=gpt-small`` (124M), ZeRO-3,
2 ranks, short windows so a step takes seconds on a CPU) saving every ``--interval`` steps, once with
synchronous saves and once with ``++ds.checkpoint.writer.decoupled=true``, and reads each run's
``metrics.json`` ``checkpoint_saves``: per save, ``blocking_s`` (training waited), ``write_s`` (until the
checkpoint was published) and ``bytes``. Prints one row per saved step and the ratio of the medians of
``blocking_s`` at the same steps; exit status 1 when it is above ``--bound`` (0.15: the issue's)::

    python benchmarks/decoupled_save.py [--model gpt-small] [--procs 2] [--steps 6] [--interval 2]
        [--bound 0.15] [--json out.json] [OVERRIDE ...]

Extra ``OVERRIDE``s go to both runs (``zero=stage2``, ``data.seq_len=256`` ...).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(overrides: list[str], run_dir: Path) -> dict:
    """``dsrun train OVERRIDES`` into ``run_dir``; its metrics.json."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "dsrun", "train", "--skip-memory-check", *overrides, f"hydra.run.dir={run_dir}"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=run_dir.parent, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"dsrun train failed ({done.returncode}): {' '.join(command)}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics["command_s"] = time.perf_counter() - started
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--zero", default="stage3")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128, help="tokens per window (the model's block size)")
    parser.add_argument("--bound", type=float, default=0.15, help="the largest acceptable ratio of the medians")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    common = [f"model={args.model}", f"zero={args.zero}", f"launcher.num_procs={args.procs}",
              f"model.block_size={args.seq}", "ds.train_micro_batch_size_per_gpu=1", "monitor=none",
              f"train.max_steps={args.steps}", f"train.save_interval={args.interval}", "train.eval_interval=0",
              "train.eval_iters=1", "train.keep_last=0", *args.overrides]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="dsrun-decoupled-") as tmp:
        for name, extra in (("sync", []), ("decoupled", ["++ds.checkpoint.writer.decoupled=true"])):
            print(f"[bench] {name}: dsrun train {' '.join(common + extra)}", flush=True)
            runs[name] = train(common + extra, Path(tmp) / name)
    saves = {name: {s["step"]: s for s in m["checkpoint_saves"]} for name, m in runs.items()}
    steps = sorted(set(saves["sync"]) & set(saves["decoupled"]))
    print(f"{'step':>5} | {'sync blocking_s':>15} | {'decoupled blocking_s':>20} | {'decoupled write_s':>17} | "
          f"{'bytes':>13}")
    for step in steps:
        sync, dec = saves["sync"][step], saves["decoupled"][step]
        print(f"{step:>5} | {sync['blocking_s']:>15.3f} | {dec['blocking_s']:>20.3f} | {dec['write_s']:>17.3f} | "
              f"{dec['bytes']:>13,}")
    medians = {name: statistics.median(saves[name][s]["blocking_s"] for s in steps) for name in saves}
    ratio = medians["decoupled"] / medians["sync"]
    step_ms = {name: statistics.median(m["step_times_ms"]) for name, m in runs.items()}
    print(f"median blocking_s: sync {medians['sync']:.3f}, decoupled {medians['decoupled']:.3f}: ratio {ratio:.3f} "
          f"(bound {args.bound}); median step: sync {step_ms['sync']:.0f} ms, decoupled {step_ms['decoupled']:.0f} ms; "
          f"whole command: sync {runs['sync']['command_s']:.0f} s, decoupled {runs['decoupled']['command_s']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"overrides": common, "steps": steps, "saves": saves, "medians": medians,
                                         "ratio": ratio, "median_step_ms": step_ms}, indent=2) + "\n")
    return 0 if ratio <= args.bound else 1


if __name__ == "__main__":
    sys.exit(main())
