"""gpt_moe (8 experts, top-2, expert parallelism 2) against dense GPTs, trained for the same steps on the same
data and seed (2 CPU ranks each): the loss curves for docs/moe.md.

    PYTHONPATH=$PWD python benchmarks/moe_vs_dense.py --steps 600 --out benchmarks/moe_vs_dense.json
    PYTHONPATH=$PWD python benchmarks/moe_vs_dense.py --steps 600 --only dense_base,gpt_moe_dropless \\
        --out benchmarks/moe_vs_dense.json        # adds runs to the file

Runs: ``gpt_moe`` (the recipe), ``dense_equal_active`` (the GPT widened until its parameter count is closest
to the MoE model's active count: attention + k experts per layer + embeddings), ``dense_base`` (the MoE
model's own width with one dense MLP per block), ``gpt_moe_dropless`` (the recipe without capacity). Prints
the eval curves, the parameter counts and the load average (tokens/s are comparable within one run only).
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


def counts() -> dict[str, int]:
    from dsrun.models.gpt import GPT
    from dsrun.models.registry import model_spec
    from dsrun.models.moe_gpt import MoEGPT

    spec = {k: v for k, v in model_spec("gpt-nano").items() if k != "_target_"}
    moe = MoEGPT(moe={"num_experts": 8, "k": 2, "every": 1, "ep_size": 1}, **spec)
    total, active = moe.moe_parameter_counts()
    best = min(range(spec["n_head"] * 8, spec["n_embd"] * 3, spec["n_head"]),
               key=lambda d: abs(GPT(**{**spec, "n_embd": d}).config.num_parameters() - active))
    return {"moe_total_params": total, "moe_active_params": active, "dense_n_embd": best,
            "dense_params": GPT(**{**spec, "n_embd": best}).config.num_parameters(),
            "dense_base_params": GPT(**spec).config.num_parameters()}


def runs(width: int) -> dict[str, list[str]]:
    return {"gpt_moe": ["+recipe=gpt_moe"], "dense_equal_active": [f"model.n_embd={width}"],
            "dense_base": [], "gpt_moe_dropless": ["+recipe=gpt_moe", "model.moe.dropless=true"]}


def train(args: list[str], steps: int, eval_interval: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="moe_bench_"))
    cmd = [sys.executable, "-m", "dsrun", "train", *args, f"train.max_steps={steps}",
           f"train.eval_interval={eval_interval}", f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    m = json.loads((out / "metrics.json").read_text())
    return {"eval_losses": m["eval_losses"], "train_losses": m["train_losses"],
            "tokens_per_second": m["tokens_per_second"], "load_average_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--only", default="gpt_moe,dense_equal_active")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    info = counts()
    result = json.loads(Path(a.out).read_text()) if a.out and Path(a.out).is_file() else {}
    result.update(info, steps=a.steps)
    table = runs(info["dense_n_embd"])
    for name in a.only.split(","):
        result[name] = train(table[name], a.steps, a.eval_interval)
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1))
    names = [n for n in table if n in result]
    print(json.dumps(info, indent=1))
    print("eval loss (nats/token) | step | " + " | ".join(names))
    for i, row in enumerate(result[names[0]]["eval_losses"]):
        print(f"| {row['step']} | " + " | ".join(f"{result[n]['eval_losses'][i]['loss']:.4f}" for n in names) + " |")
    print("tokens/s (load average): " + ", ".join(f"{n} {result[n]['tokens_per_second']:.0f} "
                                                  f"({result[n].get('load_average_1m', 0):.1f})" for n in names))


if __name__ == "__main__":
    main()
