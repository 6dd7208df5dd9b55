"""Pipeline parallelism on this machine: dsrun's GPT in 2 pipeline stages against the same GPT unpipelined.

Part 1 (two gloo ranks, one launch). Every configuration trains dsrun's GPT on the same global batch of
``m`` micro-batches (default 8 of 4 sequences), with AdamW:

* ``plain, 1 rank``    -- the whole model on rank 0 alone (torch, no engine), ``m`` micro-batches accumulated:
                          the named baseline every ratio is against;
* ``data parallel``    -- dsrun's engine, ZeRO-0, the whole model on both ranks, ``m/2`` micro-batches each;
* ``pipe <schedule>``  -- the model cut in 2 stages (``model.pipeline_stages=2``), one per rank, ``m``
                          micro-batches through the schedule (1f1b, gpipe, zero_bubble, interleaved v=2).

The configurations take turns step by step (round robin), so load from other processes hits them alike; a
step's time is the slowest rank's, the table reports medians. For each pipeline schedule it also reports
the idle fraction each stage measured (``engine.last_batch_timing``: (span - compute) / compute) next to
the unit-cost simulator's bubble, and the batch losses, which must agree between schedules (same
arithmetic, only the order differs).

Part 2 (one process). ``partition_method='profile'`` against ``'parameters'`` on a deliberately unbalanced
model: 8 layers of equal size, the first four doing 4x the work of the last four. Each stage's forward +
backward is timed (median of repeats); the figure is the slowest stage's time under each partition.

    python benchmarks/pipeline.py [--steps 6] [--micro-batches 8] [--layers 8] [--width 192] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEDULES = ("1f1b", "gpipe", "zero_bubble", "interleaved")


def model_spec(args: argparse.Namespace, stages: int) -> dict:
    return {"_target_": "dsrun.models.gpt.GPT", "vocab_size": 256, "block_size": args.seq, "n_layer": args.layers,
            "n_head": 4, "n_embd": args.width, "pipeline_stages": stages}


def ds_config(args: argparse.Namespace, accumulation: int, pipeline: dict | None = None) -> dict:
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0}}
    if pipeline is not None:
        config["pipeline"] = pipeline
    return config


def micro_batches(args: argparse.Namespace, step: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 256, (args.micro_batches, args.micro_batch, args.seq + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: "mp.Queue") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    import dsrun
    from dsrun import comm
    from dsrun.models.gpt import GPT
    from dsrun.workloads.pipeline import build_pipeline_model

    dsrun.init_distributed()
    m = args.micro_batches
    torch.manual_seed(0)
    spec = {k: v for k, v in model_spec(args, 1).items() if k != "_target_"}
    plain = GPT(**spec) if rank == 0 else None
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3) if plain is not None else None
    torch.manual_seed(0)
    dp, _, _, _ = dsrun.initialize(model=GPT(**spec), config=ds_config(args, m // world))
    engines = {}
    for schedule in SCHEDULES:
        pipe = {"schedule": schedule, "seed_layers": True}
        if schedule == "interleaved":
            pipe["virtual_stages"] = 2
        config = ds_config(args, m, pipe)
        module = build_pipeline_model(model_spec(args, world), config, world)
        engines[schedule], _, _, _ = dsrun.initialize(model=module, model_parameters=module.parameters(),
                                                      config=config)

    def plain_step(batches):
        if plain is not None:
            for x, y in batches:
                (plain(x, y) / m).backward()
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)

    def dp_step(batches):
        mine = batches[rank::world]
        for x, y in mine:
            dp.backward(dp(x, y))
            dp.step()

    runs = {"plain, 1 rank": plain_step, "data parallel, 2 ranks": dp_step}
    for schedule, engine in engines.items():
        runs[f"pipe {schedule}"] = (lambda e: lambda batches: e.train_batch(iter(batches)))(engine)
    times = {name: [] for name in runs}
    idle = {s: [] for s in SCHEDULES}
    losses = {s: [] for s in SCHEDULES}
    for step in range(args.warmup + args.steps):
        batches = micro_batches(args, step)
        for name, run in runs.items():
            comm.barrier()
            began = time.perf_counter()
            result = run(batches)
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            comm.all_reduce(elapsed, op=comm.ReduceOp.MAX)
            if name.startswith("pipe "):
                schedule = name[len("pipe "):]
                losses[schedule].append(float(result))
                if step >= args.warmup:
                    idle[schedule].append(engines[schedule].last_batch_timing["idle_fraction"])
            if step >= args.warmup:
                times[name].append(float(elapsed))
    out.put((rank, {"times": times, "idle": idle, "losses": losses}))
    comm.barrier()
    comm.destroy_process_group()


def pipeline_part(args: argparse.Namespace) -> dict:
    from tests.helpers import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, value = out.get(timeout=args.timeout)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


def simulated_bubbles(micro: int) -> dict[str, float]:
    from dsrun.pipe.schedule import TrainSchedule
    from dsrun.pipe.simulate import simulate
    from dsrun.pipe.timed import GPipeSchedule, InterleavedSchedule, ZeroBubbleSchedule

    return {"1f1b": float(simulate(TrainSchedule, 2, micro).bubble),
            "gpipe": float(simulate(GPipeSchedule, 2, micro).bubble),
            "zero_bubble": float(simulate(ZeroBubbleSchedule, 2, micro).bubble),
            "interleaved": float(simulate(InterleavedSchedule, 2, micro, virtual_stages=2).bubble)}


# --- part 2: profile against parameters ----------------------------------------------------------------------
def profile_part(repeats: int) -> dict:
    import torch
    from torch import nn

    from dsrun.pipe import LayerSpec
    from dsrun.pipe.partition import partition_layers, profiling_inputs

    torch.set_num_threads(1)

    class Repeated(nn.Module):
        def __init__(self, times: int):
            super().__init__()
            self.times = times
            self.linear = nn.Linear(256, 256)

        def forward(self, x):
            for _ in range(self.times):
                x = torch.tanh(self.linear(x))
            return x

    work = [4, 4, 4, 4, 1, 1, 1, 1]
    specs = [LayerSpec(Repeated, k) for k in work]
    example = torch.randn(256, 256)
    by_params = partition_layers(specs, 2, "parameters")
    with profiling_inputs(example):
        by_time = partition_layers(specs, 2, "profile")
    torch.manual_seed(0)
    layers = [s.build() for s in specs]

    def stage_time(lo: int, hi: int) -> float:
        samples = []
        for _ in range(repeats):
            x = example.clone().requires_grad_(True)
            began = time.perf_counter()
            y = x
            for layer in layers[lo:hi]:
                y = layer(y)
            y.sum().backward()
            samples.append(time.perf_counter() - began)
        return statistics.median(samples)

    result = {}
    for name, parts in (("parameters", by_params), ("profile", by_time)):
        stage_times = [stage_time(parts[s], parts[s + 1]) for s in range(2)]
        result[name] = {"parts": parts, "stage_s": stage_times, "slowest_s": max(stage_times)}
    result["slowest_reduction"] = 1 - result["profile"]["slowest_s"] / result["parameters"]["slowest_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--profile-repeats", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    ranks = pipeline_part(args)
    profile = profile_part(args.profile_repeats)
    load_after = os.getloadavg()[0]

    times = ranks[0]["times"]  # every rank holds the same (MAX-reduced) times
    base = statistics.median(times["plain, 1 rank"])
    sim = simulated_bubbles(args.micro_batches)
    print(f"GPT n_layer={args.layers} n_embd={args.width} seq={args.seq}; {args.micro_batches} micro-batches of "
          f"{args.micro_batch}; {args.steps} measured steps; load average {load_before:.1f} -> {load_after:.1f}")
    print(f"{'configuration':26} {'step s':>8} {'vs plain':>9} {'idle s0':>8} {'idle s1':>8} {'simulated':>9}")
    rows = {}
    for name, samples in times.items():
        med = statistics.median(samples)
        row = {"step_s": med, "ratio_vs_plain": med / base}
        line = f"{name:26} {med:8.3f} {med / base:8.2f}x"
        if name.startswith("pipe "):
            s = name[len("pipe "):]
            row["idle"] = [statistics.median(ranks[r]["idle"][s]) for r in (0, 1)]
            row["simulated_bubble"] = sim[s]
            line += f" {row['idle'][0]:8.3f} {row['idle'][1]:8.3f} {sim[s]:9.3f}"
        rows[name] = row
        print(line)
    reference = ranks[1]["losses"]["1f1b"]
    spread = max(abs(a - b) / abs(b) for s in SCHEDULES for a, b in zip(ranks[1]["losses"][s], reference))
    print(f"losses of every schedule against 1f1b: max relative difference {spread:.2e}")
    print(f"profile vs parameters (unbalanced 8 layers): cuts {profile['parameters']['parts']} -> "
          f"{profile['profile']['parts']}; slowest stage {profile['parameters']['slowest_s'] * 1e3:.1f} ms -> "
          f"{profile['profile']['slowest_s'] * 1e3:.1f} ms ({profile['slowest_reduction']:.0%} lower)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "load_average": [load_before, load_after], "configurations": rows,
                                         "schedule_loss_spread": spread, "profile": profile}, indent=1))


if __name__ == "__main__":
    main()
