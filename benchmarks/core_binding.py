"""Offload runs with and without core binding (issue 41 item 5): step time and CPU time of 2 ranks on one host.

Each run starts 2 fresh gloo ranks that train a GPT from ``conf/model/`` (default ``gpt-mini``) with ZeRO
stage 2 (or 3) and ``offload_optimizer: cpu`` (the CPU optimizer step and the host copies, the work binding is
for). *Bound*, each rank pins itself to the share of cores the launcher would give it
(:func:`dsrun.launcher.core_binding.cores_for_ranks`, NUMA-aware) and runs that many threads, as
``--bind_cores_to_rank`` does; *unbound*, each runs ``cores / ranks`` threads anywhere (dsrun's default
``OMP_NUM_THREADS``). Bound and unbound runs alternate (``--pairs`` of each); a run's step time is the median
over its measured steps of the slowest rank's step, its CPU time the median of both ranks' summed process CPU
time per step. Prints the medians over the pairs and the ratio bound / unbound (below 1: binding is faster).

    python benchmarks/core_binding.py [--pairs 3] [--steps 6] [--warmup 2] [--stage 2] [--model gpt-mini] [--json out.json]

DeepSpeed measured 15-23% shorter steps with ``--bind_cores_to_rank`` on multi-socket hosts; dsrun train binds
offload runs by default (docs/launcher.md), figures in docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ranks import rank_env, run_ranks  # noqa: E402

WORLD = 2


def rank_main(rank: int, world: int, port: int, queue, opts: dict, bound: bool) -> None:
    from dsrun.launcher.core_binding import cores_for_ranks

    if bound:
        cores = cores_for_ranks(world)[rank]
        os.sched_setaffinity(0, cores)
        threads = len(cores)
    else:
        threads = max(1, len(os.sched_getaffinity(0)) // world)
    rank_env(rank, world, port, OMP_NUM_THREADS=str(threads))
    import torch
    import yaml

    torch.set_num_threads(threads)
    import dsrun
    from dsrun import comm
    from dsrun.models.gpt import GPT

    dsrun.init_distributed(verbose=False)
    spec = yaml.safe_load((ROOT / "conf" / "model" / f"{opts['model']}.yaml").read_text())
    spec.pop("_target_", None)
    torch.manual_seed(0)
    model = GPT(**spec)
    cfg = {"train_micro_batch_size_per_gpu": opts["micro"], "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": opts["stage"], "offload_optimizer": {"device": "cpu"}}}
    engine = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    seq, vocab = int(spec["block_size"]), int(spec["vocab_size"])
    gen = torch.Generator().manual_seed(rank)
    wall, cpu = [], []
    for it in range(opts["warmup"] + opts["steps"]):
        tokens = torch.randint(0, vocab, (opts["micro"], seq + 1), generator=gen)
        comm.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start])
        slowest, summed = took[:1].clone(), took[1:].clone()
        comm.all_reduce(slowest, op=comm.ReduceOp.MAX)
        comm.all_reduce(summed)
        if it >= opts["warmup"]:
            wall.append(float(slowest))
            cpu.append(float(summed))
    engine.destroy()
    if rank == 0:
        queue.put({"step_s": statistics.median(wall), "cpu_s": statistics.median(cpu), "threads": threads})


def one_run(opts: dict, bound: bool) -> dict:
    return run_ranks(rank_main, WORLD, opts, bound, results=1)[0]  # rank 0's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from dsrun.launcher.core_binding import cores_for_ranks, describe, numa_nodes

    opts = {"steps": args.steps, "warmup": args.warmup, "stage": args.stage, "model": args.model, "micro": args.micro}
    runs: dict[str, list[dict]] = {"bound": [], "unbound": []}
    loads = []
    for _ in range(args.pairs):
        for name in ("bound", "unbound"):
            loads.append(os.getloadavg()[0])
            runs[name].append(one_run(opts, bound=name == "bound"))
    summary = {name: {key: statistics.median(r[key] for r in rs) for key in ("step_s", "cpu_s")}
               for name, rs in runs.items()}
    summary["bound_vs_unbound"] = summary["bound"]["step_s"] / summary["unbound"]["step_s"]
    summary["cpu_bound_vs_unbound"] = summary["bound"]["cpu_s"] / summary["unbound"]["cpu_s"]
    print(f"{args.model}, ZeRO-{args.stage} offload_optimizer=cpu, {WORLD} ranks, {len(os.sched_getaffinity(0))} cores, "
          f"{len(numa_nodes()) or 1} NUMA node(s); binding {describe(cores_for_ranks(WORLD))}; {args.pairs} pairs of "
          f"{args.steps} steps (load average {min(loads):.1f}-{max(loads):.1f})")
    for name in ("bound", "unbound"):
        each = ", ".join(f"{r['step_s']:.4f}" for r in runs[name])
        print(f"{name:<9} step {summary[name]['step_s']:.4f} s  CPU {summary[name]['cpu_s']:.4f} s  (runs: {each})")
    print(f"bound / unbound: step {summary['bound_vs_unbound']:.2f}x, CPU {summary['cpu_bound_vs_unbound']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary, "loads": loads}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
