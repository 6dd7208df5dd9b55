"""``compile.offload_parameters`` (DeepCompile's parameter offload) against the same DeepCompile run without it.

Two gloo ranks train dsrun's default GPT (``conf/model/gpt-nano.yaml``, micro batch 16) at ZeRO-3 with
DeepCompile, once with ``zero3_compile`` alone and once with the key (its schedule: ``zero3_compile`` and
``offload_parameters`` from step 0), in fp32 and in bf16. The handle is one per process (one DeepCompile engine at
a time), so the two runs of a dtype follow each other instead of taking turns. Reported per run: the median step
(slowest rank's forward + backward + step) and CPU time (both ranks) after ``--warmup`` steps; the shard bytes on
the training device at the end of the forward (where activations peak) and at most within a step, out of all of
them; the host buffers' bytes; whether the losses equal the run without the key, bit for bit.

On a CPU the host buffers are memory of the same kind: what the figures show is the shards' training-time storage
freed between uses, not a drop of the process's memory (docs/deepcompile.md).

    python benchmarks/offload_parameters.py [--dtypes fp32 bf16] [--steps 10] [--warmup 2] [--backend eager]
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
from compile_zero import model_options  # noqa: E402
from ranks import rank_env, run_ranks  # noqa: E402


def _run(opts: dict, dtype: str, offload: bool, rank: int) -> dict:
    import torch

    import dsrun
    from dsrun import comm
    from dsrun.compile.handle import get_deepcompile_handle
    from dsrun.models.gpt import GPT

    spec = model_options(opts["model"])
    if opts["untied"]:
        spec["tie_embeddings"] = False
    seq = int(spec["block_size"])
    torch.manual_seed(0)
    model = GPT(**spec)
    cfg = {"train_micro_batch_size_per_gpu": opts["micro"], "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3},
           "bf16": {"enabled": dtype == "bf16"}, "compile": {"deepcompile": True, "offload_parameters": offload}}
    torch._dynamo.reset()
    engine = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    engine.compile(backend=opts["backend"], schedule=None if offload else [(0, ["zero3_compile"])])
    moves = get_deepcompile_handle().param_moves
    gen = torch.Generator().manual_seed(rank)
    wall, cpu, losses, at_forward_end, peak = [], [], [], [], []
    for it in range(opts["warmup"] + opts["steps"]):
        tokens = torch.randint(0, int(spec["vocab_size"]), (opts["micro"], seq + 1), generator=gen)
        comm.barrier()
        if moves is not None:
            moves.reset_stats()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        resident = moves.resident_bytes() if moves is not None else None
        engine.backward(loss)
        engine.step()
        took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start])
        wall_max, cpu_sum = took[:1].clone(), took[1:].clone()
        comm.all_reduce(wall_max, op=comm.ReduceOp.MAX)
        comm.all_reduce(cpu_sum)
        losses.append(loss.float().item())
        if it >= opts["warmup"]:
            wall.append(float(wall_max))
            cpu.append(float(cpu_sum))
            if moves is not None:
                at_forward_end.append(resident)
                peak.append(moves.stats.peak_resident_bytes)
    shard_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.strategy.params)
    row = {"step_s": statistics.median(wall), "cpu_s": statistics.median(cpu), "losses": losses,
           "shard_bytes": shard_bytes}
    if moves is not None:
        row.update(units=len(moves.units), moved_bytes=moves.total_bytes(), host_bytes=moves.host_bytes(),
                   resident_at_forward_end=max(at_forward_end), peak_resident_in_step=max(peak),
                   late_reloads=moves.stats.late_reloads)
    engine.destroy()
    return row


def rank_main(rank: int, world: int, port: int, queue, opts: dict) -> None:
    rank_env(rank, world, port)
    import torch

    torch.set_num_threads(opts["threads"])
    import dsrun

    dsrun.init_distributed(verbose=False)
    results = {}
    for dtype in opts["dtypes"]:
        off = _run(opts, dtype, False, rank)
        on = _run(opts, dtype, True, rank)
        results[dtype] = {"off": off, "on": on, "losses_equal": off["losses"] == on["losses"]}
    if rank == 0:
        queue.put(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="gpt-nano")
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--backend", default="eager", choices=["eager", "aot_eager", "inductor"])
    parser.add_argument("--untied", action="store_true", help="the GPT with its own output head (the tied head's "
                        "shard stays on the device from the forward's start to the head: docs/deepcompile.md)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    world = 2
    opts = {"dtypes": args.dtypes, "steps": args.steps, "warmup": args.warmup, "model": args.model,
            "micro": args.micro, "backend": args.backend, "untied": args.untied, "threads": max(1, (os.cpu_count() or 2) // world)}
    load_before = os.getloadavg()[0]
    results = run_ranks(rank_main, world, opts, results=1, timeout=3600)[0]
    print(f"{args.model}{' (untied head)' if args.untied else ''}, {world} gloo ranks x {opts['threads']} threads, micro batch {args.micro}, backend "
          f"{args.backend}, median of {args.steps} steps after {args.warmup} (load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after)")
    for dtype, r in results.items():
        on, off = r["on"], r["off"]
        print(f"{dtype}: step {off['step_s']:.4f} s off, {on['step_s']:.4f} s on ({on['step_s'] / off['step_s']:.2f}x); "
              f"CPU {off['cpu_s']:.4f} s off, {on['cpu_s']:.4f} s on; losses equal: {r['losses_equal']}")
        print(f"    shards {on['shard_bytes']} B per rank ({on['units']} units moving {on['moved_bytes']} B); on the "
              f"device at the forward's end: {on['resident_at_forward_end']} B (off: {off['shard_bytes']} B), at "
              f"most within a step: {on['peak_resident_in_step']} B; host buffers {on['host_bytes']} B; "
              f"late reloads {on['late_reloads']}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "untied": args.untied, "backend": args.backend,
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
