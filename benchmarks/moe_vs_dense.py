"""gpt_moe (8 experts, top-2, expert parallelism 2) against a dense GPT with the same active parameters per
token, trained for the same steps on the same data (2 CPU ranks each): the loss curves for docs/moe.md.

    PYTHONPATH=$PWD python benchmarks/moe_vs_dense.py --steps 120 --out benchmarks/moe_vs_dense.json

The dense model's width is chosen so its parameter count is closest to the MoE model's active count
(attention + k experts per MoE layer + embeddings). Prints both curves, the parameter counts and the load
average the run saw (the timing columns are only comparable within one run).
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
sys.path.insert(0, str(REPO))


def counts() -> tuple[int, int, int, int]:
    """(MoE total params, MoE active params, dense n_embd, dense params)."""
    from dsrun.models.gpt import GPT
    from dsrun.moe.gpt import MoEGPT
    from dsrun.models.registry import model_spec

    spec = {k: v for k, v in model_spec("gpt-nano").items() if k != "_target_"}
    moe = MoEGPT(moe={"num_experts": 8, "k": 2, "every": 1, "ep_size": 1}, **spec)
    total, active = moe.moe_parameter_counts()
    best = min(range(spec["n_head"] * 8, spec["n_embd"] * 3, spec["n_head"]),
               key=lambda d: abs(GPT(**{**spec, "n_embd": d}).config.num_parameters() - active))
    return total, active, best, GPT(**{**spec, "n_embd": best}).config.num_parameters()


def train(args: list[str], steps: int, eval_interval: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="moe_bench_"))
    cmd = [sys.executable, "-m", "dsrun", "train", *args, f"train.max_steps={steps}",
           f"train.eval_interval={eval_interval}", f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads((out / "metrics.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    total, active, width, dense_params = counts()
    load = os.getloadavg()[0]
    moe = train(["+recipe=gpt_moe"], a.steps, a.eval_interval)
    dense = train([f"model.n_embd={width}"], a.steps, a.eval_interval)
    result = {"moe_total_params": total, "moe_active_params": active, "dense_n_embd": width,
              "dense_params": dense_params, "steps": a.steps, "load_average_1m": load,
              "moe": {"eval_losses": moe["eval_losses"], "train_losses": moe["train_losses"],
                      "tokens_per_second": moe["tokens_per_second"]},
              "dense": {"eval_losses": dense["eval_losses"], "train_losses": dense["train_losses"],
                        "tokens_per_second": dense["tokens_per_second"]}}
    print(json.dumps({k: v for k, v in result.items() if k not in ("moe", "dense")}, indent=1))
    print("eval loss (nats/token): step | gpt_moe | dense")
    for m, d in zip(moe["eval_losses"], dense["eval_losses"]):
        print(f"{m['step']:5d} | {m['loss']:.4f} | {d['loss']:.4f}")
    print(f"tokens/s (same run, load {load:.1f}): gpt_moe {moe['tokens_per_second']:.0f}, "
          f"dense {dense['tokens_per_second']:.0f}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
