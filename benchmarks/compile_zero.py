"""``compile.enabled`` against eager under ZeRO 0-3: step time, CPU time, graph breaks (issue 41 item 4).

Two gloo ranks on this machine train dsrun's default GPT (``conf/model/gpt-nano.yaml``, the model ``dsrun train``
builds when nothing is overridden; its micro batch of 16 sequences of ``block_size`` tokens) with AdamW, once
eagerly and once with ``compile: {enabled: true, backend: inductor}``, at each ZeRO stage. Each rank holds both
engines of a stage and they take turns step by step, so load from other processes hits them alike. A step's
time is the slowest rank's forward + backward + optimizer step; its CPU time is the sum of both ranks' process
CPU time (what a busy machine distorts least). The first compiled step (the compilation) is reported apart and
left out of the medians; dynamo's graph breaks and graphs are counted over that first step.

    python benchmarks/compile_zero.py [--stages 0 1 2 3] [--steps 10] [--warmup 2] [--model gpt-nano] [--json out.json]
    python benchmarks/compile_zero.py --stages 3 --deepcompile   # also DeepCompile at ZeRO-3 (docs/deepcompile.md)

Target (issue 41): compiled at least 1.2x faster than eager at stages 0-2 (CPU inductor, the default GPT).
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


def model_options(name: str) -> dict:
    import yaml

    spec = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    spec.pop("_target_", None)
    return spec


def rank_main(rank: int, world: int, port: int, queue, opts: dict) -> None:
    rank_env(rank, world, port)
    import torch

    torch.set_num_threads(opts["threads"])
    import dsrun
    from dsrun import comm
    from dsrun.models.gpt import GPT
    from torch._dynamo.utils import counters

    dsrun.init_distributed(verbose=False)
    spec = model_options(opts["model"])
    seq = int(spec["block_size"])
    results = {}
    for stage in opts["stages"]:
        torch._dynamo.reset()  # each stage compiles afresh (else stages 1-2 reuse stage 0's graph): its own counts
        engines = {}
        modes = ("eager", "compiled") + (("deepcompile",) if opts["deepcompile"] and stage == 3 else ())
        for mode in modes:
            torch.manual_seed(0)
            model = GPT(**spec)
            cfg = {"train_micro_batch_size_per_gpu": opts["micro"], "steps_per_print": 10**6,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                   "zero_optimization": {"stage": stage},
                   "compile": {"enabled": mode != "eager", "backend": opts["backend"],
                               "deepcompile": mode == "deepcompile"}}
            engines[mode] = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        gen = torch.Generator().manual_seed(rank)
        wall = {m: [] for m in engines}
        cpu = {m: [] for m in engines}
        first, breaks, graphs = {}, {}, {}
        for it in range(1 + opts["warmup"] + opts["steps"]):
            tokens = torch.randint(0, int(spec["vocab_size"]), (opts["micro"], seq + 1), generator=gen)
            for mode, engine in engines.items():
                comm.barrier()
                if it == 0:
                    counters.clear()
                start, cpu_start = time.perf_counter(), time.process_time()
                loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start])
                if it == 0 and mode != "eager":
                    breaks[mode] = int(sum(counters["graph_break"].values()))
                    graphs[mode] = int(counters["stats"]["unique_graphs"])
                wall_max = took[:1].clone()
                comm.all_reduce(wall_max, op=comm.ReduceOp.MAX)
                cpu_sum = took[1:].clone()
                comm.all_reduce(cpu_sum)
                if it == 0:
                    first[mode] = float(wall_max)
                elif it > opts["warmup"]:
                    wall[mode].append(float(wall_max))
                    cpu[mode].append(float(cpu_sum))
        row = {f"{m}_{k}": statistics.median(v) for m in engines for k, v in (("step_s", wall[m]), ("cpu_s", cpu[m]))}
        row.update(first_compiled_step_s=first["compiled"], graph_breaks=breaks["compiled"],
                   graphs=graphs["compiled"], speedup=row["eager_step_s"] / row["compiled_step_s"],
                   cpu_speedup=row["eager_cpu_s"] / row["compiled_cpu_s"])
        if "deepcompile" in engines:  # DeepCompile: ZeRO-3 in the graph (dsrun/compile)
            row.update(first_deepcompile_step_s=first["deepcompile"], deepcompile_graph_breaks=breaks["deepcompile"],
                       deepcompile_graphs=graphs["deepcompile"],
                       deepcompile_speedup=row["eager_step_s"] / row["deepcompile_step_s"],
                       deepcompile_cpu_speedup=row["eager_cpu_s"] / row["deepcompile_cpu_s"],
                       deepcompile_vs_compiled=row["compiled_step_s"] / row["deepcompile_step_s"])
        results[f"zero{stage}"] = row
        for engine in engines.values():
            engine.destroy()
    if rank == 0:
        queue.put(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="gpt-nano", help="a file of conf/model/ (default: dsrun's default)")
    parser.add_argument("--micro", type=int, default=16, help="sequences per rank per step (dsrun's default: 16)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--deepcompile", action="store_true",
                        help="at ZeRO-3 also DeepCompile (compile.deepcompile: ZeRO-3 in the graph, DeepSpeed's schedule)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    world = 2
    opts = {"stages": args.stages, "steps": args.steps, "warmup": args.warmup, "model": args.model,
            "micro": args.micro, "backend": args.backend, "deepcompile": args.deepcompile, "threads": max(1, (os.cpu_count() or 2) // world)}
    results = run_ranks(rank_main, world, opts, results=1, timeout=3600)[0]  # rank 0's
    print(f"{args.model}, {world} gloo ranks x {opts['threads']} threads, micro batch {args.micro}, backend "
          f"{args.backend}, median of {args.steps} steps (load average {os.getloadavg()[0]:.1f})")
    print(f"{'stage':<7}{'eager s':>9}{'compiled s':>12}{'speedup':>9}{'CPU speedup':>13}{'1st compiled s':>16}"
          f"{'breaks':>8}{'graphs':>8}")
    for stage, r in results.items():
        print(f"{stage:<7}{r['eager_step_s']:>9.4f}{r['compiled_step_s']:>12.4f}{r['speedup']:>8.2f}x"
              f"{r['cpu_speedup']:>12.2f}x{r['first_compiled_step_s']:>16.1f}{r['graph_breaks']:>8}{r['graphs']:>8}")
        if "deepcompile_step_s" in r:
            print(f"{'  deepcompile':<19}{r['deepcompile_step_s']:>9.4f}{r['deepcompile_speedup']:>8.2f}x"
                  f"{r['deepcompile_cpu_speedup']:>12.2f}x{r['first_deepcompile_step_s']:>16.1f}"
                  f"{r['deepcompile_graph_breaks']:>8}{r['deepcompile_graphs']:>8}  "
                  f"({r['deepcompile_vs_compiled']:.2f}x the per-block compile)")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "backend": args.backend, "stages": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
