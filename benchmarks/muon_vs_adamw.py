"""Muon against AdamW on the default recipe's model (gpt-nano on the Python standard library's bytes, 2 CPU
ranks, ZeRO-2, warm-up + cosine, 300 steps, seed 1234), each at its best learning rate from a small sweep:
the figures of docs/muon.md.

    PYTHONPATH=$PWD python benchmarks/muon_vs_adamw.py --out benchmarks/muon_vs_adamw.json

AdamW runs the default recipe as it is (``optimizer=adamw``, ``gradient_clipping`` 1.0) at each ``--adamw-lrs``;
Muon runs ``+recipe=gpt_muon`` (``optimizer=muon``, no clipping) at each ``--muon-lrs``, its auxiliary Adam (the
embeddings, the tied head, biases and norms) at AdamW's best lr. ``--out`` keeps the runs a previous call wrote
there (a Muon run only if its auxiliary lr is still AdamW's best), so a sweep can be widened run by run. Every run starts from the same weights and
sees the same batches. Prints each run's final eval and train loss and its tokens/s, then the best of each
and the ratio Muon / AdamW of their final eval losses (below 1: Muon ends lower).
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


def train(args: list[str], steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="muon_bench_"))
    cmd = [sys.executable, "-m", "dsrun", "train", *args, f"train.max_steps={steps}", f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    m = json.loads((out / "metrics.json").read_text())
    return {"args": args, "final_eval_loss": m["eval_losses"][-1]["loss"], "final_train_loss": m["train_losses"][-1],
            "eval_losses": m["eval_losses"], "tokens_per_second": m["tokens_per_second"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--adamw-lrs", default="1e-3,3e-3,6e-3,1e-2,2e-2")
    parser.add_argument("--muon-lrs", default="0.01,0.02,0.05")
    parser.add_argument("--out", default=None, help="the JSON written; runs already in it (same steps) are kept")
    a = parser.parse_args()
    result: dict = {"steps": a.steps, "adamw": {}, "muon": {}}
    if a.out and Path(a.out).is_file() and json.loads(Path(a.out).read_text())["steps"] == a.steps:
        result = json.loads(Path(a.out).read_text())
    for lr in a.adamw_lrs.split(","):
        if lr not in result["adamw"]:
            result["adamw"][lr] = train(["optimizer=adamw", f"ds.optimizer.params.lr={lr}"], a.steps)
    best_adamw = min(result["adamw"], key=lambda lr: result["adamw"][lr]["final_eval_loss"])
    for lr in a.muon_lrs.split(","):
        if result["muon"].get(lr, {}).get("adam_lr") == best_adamw:
            continue
        result["muon"][lr] = train(["+recipe=gpt_muon", f"ds.optimizer.params.muon_lr={lr}",
                                    f"ds.optimizer.params.adam_lr={best_adamw}"], a.steps)
        result["muon"][lr]["adam_lr"] = best_adamw
    best_muon = min(result["muon"], key=lambda lr: result["muon"][lr]["final_eval_loss"])
    adamw, muon = result["adamw"][best_adamw], result["muon"][best_muon]
    result["best"] = {"adamw_lr": best_adamw, "muon_lr": best_muon, "adamw": adamw["final_eval_loss"],
                      "muon": muon["final_eval_loss"], "ratio": muon["final_eval_loss"] / adamw["final_eval_loss"]}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    print("| optimizer | lr | final eval loss | final train loss | tokens/s |")
    print("|---|---|---|---|---|")
    for name in ("adamw", "muon"):
        for lr, run in result[name].items():
            print(f"| {name} | {lr} | {run['final_eval_loss']:.4f} | {run['final_train_loss']:.4f} | "
                  f"{run['tokens_per_second']:.0f} |")
    best = result["best"]
    print(f"best: AdamW lr {best['adamw_lr']} {best['adamw']:.4f}, Muon lr {best['muon_lr']} {best['muon']:.4f}, "
          f"ratio Muon / AdamW {best['ratio']:.4f}")


if __name__ == "__main__":
    main()
