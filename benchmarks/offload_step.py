"""Step time of ZeRO with the optimizer offloaded (CPU, NVMe) against in-memory ZeRO on the same model.

One process (a gloo world of one) trains the same GPT (bf16, AdamW) under each configuration; the
configurations take turns step by step (round robin) so load from other processes hits them alike. A step
is forward + backward + optimizer step; the table reports medians over the measured steps and the ratio to
in-memory ZeRO of the same stage. For NVMe it also reports the optimizer step alone, pipelined
(``buffer_count`` 12: three slots, reads of sub-group i+1 and writes of i-1 in flight while i is updated)
against serial (``buffer_count`` 4: read, update, write one after the other), and the pipeline's split of
the step into compute and time blocked on I/O, to show the overlap.

    python benchmarks/offload_step.py [--steps 8] [--warmup 2] [--layers 6] [--width 768]
                                      [--sub-group 2000000] [--nvme-path /tmp] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def configs(sub_group: int, nvme_path: str) -> dict[str, dict]:
    def zero(stage: int, offload: dict | None = None) -> dict:
        z = {"stage": stage, "sub_group_size": sub_group, "reduce_bucket_size": 50_000_000,
             "stage3_param_persistence_threshold": 0}
        if offload:
            z["offload_optimizer"] = offload
        return z

    nvme = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
    return {
        "zero2": zero(2), "zero2+cpu": zero(2, {"device": "cpu", "pin_memory": True}),
        "zero3": zero(3), "zero3+cpu": zero(3, {"device": "cpu", "pin_memory": True}),
        "zero3+nvme": zero(3, {**nvme, "buffer_count": 12}),
        "zero3+nvme serial": zero(3, {**nvme, "buffer_count": 4}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--sub-group", type=int, default=2_000_000)
    parser.add_argument("--nvme-path", default=None, help="folder for the swap files (default: a temp folder)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    import dsrun
    from dsrun.models.config import GPTConfig
    from dsrun.models.gpt import GPT

    torch.set_num_threads(args.threads)
    nvme_root = args.nvme_path or tempfile.mkdtemp(prefix="dsrun_offload_bench_")
    gpt = dict(vocab_size=4096, block_size=64, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width,
               dropout=0.0)
    engines = {}
    for name, zero in configs(args.sub_group, nvme_root).items():
        torch.manual_seed(0)
        model = GPT(**gpt)
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero,
               "steps_per_print": 10_000}
        engines[name] = dsrun.initialize(model=model, config=cfg)[0]
    numel = GPTConfig.from_kwargs(gpt).num_parameters()
    gen = torch.Generator().manual_seed(1)
    times = {name: [] for name in engines}
    opt_times = {name: [] for name in engines}
    split = {name: [] for name in engines}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, 4096, (4, 65), generator=gen)
        for name, engine in engines.items():
            t0 = time.perf_counter()
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            t1 = time.perf_counter()
            engine.step()
            t2 = time.perf_counter()
            if step >= args.warmup:
                times[name].append(t2 - t0)
                opt_times[name].append(t2 - t1)
                pipeline = getattr(engine.strategy, "last_step_times", None)
                if pipeline is not None:
                    split[name].append((pipeline.total, pipeline.compute, pipeline.waiting))
    load = os.getloadavg()
    rows = {}
    print(f"GPT {numel / 1e6:.1f}M params, bf16, AdamW, 1 process x {args.threads} threads, sub_group_size "
          f"{args.sub_group}, {args.steps} steps after {args.warmup} warm-up; load average {load[0]:.1f} "
          f"{load[1]:.1f} {load[2]:.1f}")
    print(f"{'config':<20} {'step s':>8} {'ratio':>6} {'opt step s':>10} {'pipeline: total / compute / blocked s':>40}")
    for name in engines:
        med = statistics.median(times[name])
        base = statistics.median(times["zero2" if name.startswith("zero2") else "zero3"])
        opt = statistics.median(opt_times[name])
        parts = ""
        if split[name]:
            total, compute, waiting = (statistics.median(x[i] for x in split[name]) for i in range(3))
            parts = f"{total:.3f} / {compute:.3f} / {waiting:.3f}"
        rows[name] = {"step_s": med, "ratio": med / base, "opt_step_s": opt, "pipeline": parts}
        print(f"{name:<20} {med:8.3f} {med / base:6.2f} {opt:10.3f} {parts:>40}")
    piped, serial = rows["zero3+nvme"]["opt_step_s"], rows["zero3+nvme serial"]["opt_step_s"]
    print(f"NVMe optimizer step: pipelined {piped:.3f} s vs serial {serial:.3f} s ({serial / piped:.2f}x)")
    for engine in engines.values():
        close = getattr(engine.strategy, "close", None)
        if close is not None:
            close()
    if args.json:
        Path(args.json).write_text(json.dumps({"numel": numel, "load": load, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
