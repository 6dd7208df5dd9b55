"""``data_types.grad_accum_dtype``: the gradient bytes each ZeRO stage holds with and without it, counted, for GPT-2
small (124M) in bf16 on one CPU rank — the figures of docs/precision.md.

    PYTHONPATH=$PWD python benchmarks/grad_accum_dtype.py --out benchmarks/grad_accum_dtype.json
    PYTHONPATH=$PWD python benchmarks/grad_accum_dtype.py --model gpt-nano   # a quick run

For each stage, the stage's own accumulation and the other dtype (stage 1: bf16 -> fp32, DeepSpeed's BF16_Optimizer;
stages 2-3: fp32 -> bf16): ``strategy.memory_breakdown()`` after one optimizer step of two micro-steps (its
``gradients`` bytes, and the model states in all), the estimator's gradient bytes and model states for the same
settings (``dsrun.estimate.model_state_bytes``), and the step's CPU time (``time.process_time``, both micro-steps
and the update; on a loaded machine indicative only).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = {"gpt-small": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257},
          "gpt-nano": {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256}}
VARIANTS = {1: (None, "fp32"), 2: (None, "bf16"), 3: (None, "bf16")}
BLOCK = 128


def measure(model_name: str, stage: int, accum: str | None) -> dict:
    import torch

    import dsrun
    from dsrun.estimate.inputs import EstimateInputs
    from dsrun.estimate.model_states import model_state_bytes
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    shape = MODELS[model_name]
    model = GPT(block_size=BLOCK, **shape)
    total = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    engine = dsrun.initialize(model=model, config=config)[0]
    idx = torch.randint(0, shape["vocab_size"], (1, BLOCK))
    start = time.process_time()
    for _ in range(2):
        loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
    cpu_s = time.process_time() - start
    held = engine.strategy.memory_breakdown()
    largest = max(p.numel() for p in engine.module.parameters()) if stage < 3 else 0
    spec = EstimateInputs(total_params=total, largest_layer_params=max(largest, 1), zero_stage=stage,
                          precision="bf16", optimizer="AdamW", device="cpu", grad_accum_dtype=accum)
    estimate = model_state_bytes(spec)
    engine.destroy()
    return {"stage": stage, "grad_accum_dtype": accum or "(the stage's own)", "params": total,
            "gradient_bytes": held.gradients, "model_state_bytes": held.total - held.buffers,
            "estimated_gradient_bytes": estimate.device_gradients, "estimated_model_state_bytes": estimate.device_total,
            "step_cpu_s": round(cpu_s, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt-small")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--probe", type=int, default=None, help=argparse.SUPPRESS)  # one stage, in this process
    args = parser.parse_args()
    if args.probe is not None:
        import torch.distributed as dist

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo")
        for accum in VARIANTS[args.probe]:
            print(json.dumps(measure(args.model, args.probe, accum)), flush=True)
        dist.destroy_process_group()
        return
    rows = []
    for stage in args.stages:  # a process per stage: GPT-2 small's engines do not all fit one process's memory
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--probe", str(stage)], check=True,
                             capture_output=True, text=True).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    mib = 2 ** 20
    print("| stage | grad_accum_dtype | gradient bytes held | estimator | model states | estimator | step CPU s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['grad_accum_dtype']} | {r['gradient_bytes'] / mib:.1f} MiB "
              f"({r['gradient_bytes'] / r['params']:.0f} B/param) | {r['estimated_gradient_bytes'] / mib:.1f} MiB | "
              f"{r['model_state_bytes'] / mib:.1f} MiB | {r['estimated_model_state_bytes'] / mib:.1f} MiB | "
              f"{r['step_cpu_s']} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
