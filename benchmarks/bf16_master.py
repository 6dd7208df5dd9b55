"""bf16 master state against fp32 masters: peak memory (tensor bytes and RSS) of GPT-2 small (124M) and the final
loss of the default recipe's gpt-nano, the figures of docs/precision.md.

    PYTHONPATH=$PWD python benchmarks/bf16_master.py --out benchmarks/bf16_master.json

Variants (all bf16 models): ``fp32 masters`` (``bf16.enabled`` only: fp32 masters, gradients and Adam moments),
``bf16 master+states`` (``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``). DeepSpeed's third mix,
bf16 masters with fp32 states, needs ZeRO-Offload's CPU Adam and is refused by dsrun (docs/precision.md).

* **Memory**: GPT-2 small (model=gpt-small, 124M parameters, 128-token sequences, micro batch 1) on one CPU rank
  at ZeRO stages 2 and 3, two AdamW steps. For each: the engine's own tensor bytes after the steps
  (``strategy.memory_breakdown()``, a rank-like subprocess of this script: ``--probe``), the estimator's model
  states for the same settings, and ``dsrun estimate-memory --measure``'s predicted and measured peak RSS.
* **Loss**: the default recipe (gpt-nano on the standard library's bytes, 2 ranks, warm-up + cosine, seed 1234,
  300 steps) at ZeRO-2: fp32 training, bf16 with fp32 masters, bf16 master state. Final eval and train loss and
  tokens/s (a loaded machine: tokens/s are indicative only).
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
VARIANTS = {"fp32 masters": [], "bf16 master+states": ["ds.bf16.bf16_master_weights_and_grads=true",
                                                        "ds.bf16.bf16_optimizer_states=true"]}
MEMORY_MODEL = ["model=gpt-small", "model.block_size=128", "ds.train_micro_batch_size_per_gpu=1",
                "ds.gradient_accumulation_steps=1", "launcher.num_procs=1", "precision=bf16", "optimizer=adamw"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536"}


def probe(stage: int, variant: str, steps: int = 2) -> dict:
    """In this process (a world of one): GPT-2 small through dsrun.initialize, ``steps`` AdamW steps; the engine's
    tensor bytes, the process's peak RSS above its start, the mean step time."""
    import torch
    import torch.distributed as dist

    import dsrun
    from dsrun.estimate.measure import current_rss, rank_peak_bytes
    from dsrun.models.gpt import GPT

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    start = current_rss()
    model = GPT(vocab_size=50257, block_size=128, n_layer=12, n_head=12, n_embd=768)
    bf16 = {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                if VARIANTS[variant] else {})}
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "bf16": bf16, "zero_optimization": {"stage": stage}}
    engine = dsrun.initialize(model=model, config=config)[0]
    idx = torch.randint(0, 50257, (1, 128))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    breakdown = engine.strategy.memory_breakdown().as_dict()
    return {"stage": stage, "variant": variant, "tensor_bytes": breakdown, "peak_rss_above_start": rank_peak_bytes(0)
            - start, "params": sum(p.numel() for p in model.parameters()), "step_s": times[1:] or times}


def estimate_cli(stage: int, variant: str, steps: int) -> dict:
    """``dsrun estimate-memory ... --measure --json``: the estimator's model states and peak, and the measured peak."""
    cmd = [sys.executable, "-m", "dsrun", "estimate-memory", *MEMORY_MODEL, f"zero=stage{stage}", *VARIANTS[variant],
           "--measure", "--measure-steps", str(steps), "--json"]
    out = subprocess.run(cmd, check=True, env=ENV, cwd=REPO, capture_output=True, text=True).stdout
    report = json.loads(out[out.index("{"):])
    return {"recipe": report["recipe"], "measured": report["measured"]}


def train(args: list[str], steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bf16_master_bench_"))
    cmd = [sys.executable, "-m", "dsrun", "train", "zero=stage2", *args, f"train.max_steps={steps}",
           f"hydra.run.dir={out}"]
    subprocess.run(cmd, check=True, env={**ENV, "OMP_NUM_THREADS": "1"}, cwd=REPO, stdout=subprocess.DEVNULL)
    m = json.loads((out / "metrics.json").read_text())
    return {"args": args, "final_eval_loss": m["eval_losses"][-1]["loss"], "final_train_loss": m["train_losses"][-1],
            "tokens_per_second": m["tokens_per_second"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probe", nargs=2, metavar=("STAGE", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the loss runs")
    parser.add_argument("--stages", default="2,3", help="ZeRO stages of the memory runs")
    parser.add_argument("--skip-loss", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    if a.probe:
        print(json.dumps(probe(int(a.probe[0]), a.probe[1])))
        return
    result: dict = json.loads(Path(a.out).read_text()) if a.out and Path(a.out).is_file() else {}
    if not a.skip_memory:
        result["memory"] = []
        for stage in (int(s) for s in a.stages.split(",")):
            for variant in VARIANTS:
                out = subprocess.run([sys.executable, __file__, "--probe", str(stage), variant], check=True, env=ENV,
                                     cwd=REPO, capture_output=True, text=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                row["estimate"] = estimate_cli(stage, variant, steps=2)
                result["memory"].append(row)
                print(json.dumps(row)[:400], flush=True)
    if not a.skip_loss:
        result["loss"] = {"fp32 training": train([], a.steps)}
        for variant, keys in VARIANTS.items():
            result["loss"][variant] = train(["precision=bf16", *keys], a.steps)
            print(variant, result["loss"][variant], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    report(result)


def report(result: dict) -> None:
    mib = 2 ** 20
    if "memory" in result:
        print("| stage | variant | engine model states (+ kept buffers) | estimator model states | peak RSS measured "
              "| predicted | error | step s |")
        print("|---|---|---|---|---|---|---|---|")
        for row in result["memory"]:
            measured = row["estimate"]["measured"][0]
            states = row["estimate"]["recipe"]["model_states"]
            held = row["tensor_bytes"]
            print(f"| {row['stage']} | {row['variant']} | {(held['total'] - held['buffers']) / mib:.0f} MiB "
                  f"(+ {held['buffers'] / mib:.0f}) | {states / mib:.0f} MiB | {measured['measured'] / mib:.0f} MiB | "
                  f"{measured['predicted'] / mib:.0f} MiB | {measured['error_pct']:+.1f}% | "
                  f"{sum(row['step_s']) / len(row['step_s']):.1f} |")
    if "loss" in result:
        print("| run | final eval loss | final train loss | tokens/s |")
        print("|---|---|---|---|")
        for name, run in result["loss"].items():
            print(f"| {name} | {run['final_eval_loss']:.4f} | {run['final_train_loss']:.4f} | "
                  f"{run['tokens_per_second']:.0f} |")


if __name__ == "__main__":
    main()
