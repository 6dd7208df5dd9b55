"""Bytes per rank under plain ZeRO-3, MiCS and hpZ: parameter memory and each process group's traffic per step.

    python benchmarks/mics_hpz.py [--ranks 4] [--width 128] [--layers 4] [--out benchmarks/mics_hpz_results.json]

Spawns ``--ranks`` gloo ranks on this machine and trains dsrun's GPT (fp32, AdamW, micro-batch 2 x 64
tokens) for 3 steps per layout: plain ZeRO-3, MiCS with shard groups of ranks/2, hpZ with secondary groups
of ranks/2. For the last step it reports, per rank 0, ``memory_breakdown().parameters`` and the comms
logger's traffic bytes (the bandwidth-optimal ring's, see dsrun/comm/logger.py) per op and per process group
(named by its global ranks), split between forward and backward+step. No prefetching and no reuse
distance, so each pass gathers every parameter itself. Bytes are exact counts, not timings.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def layouts(ranks: int) -> dict[str, dict]:
    half = max(1, ranks // 2)
    return {"zero3": {}, f"mics{half}": {"mics_shard_size": half}, f"hpz{half}": {"zero_hpz_partition_size": half}}


def _traffic(stats: dict) -> dict:
    return {op: {group: s["traffic_bytes"] for group, s in groups.items()} for op, groups in stats.items()}


def rank_main(rank: int, ranks: int, port: int, width: int, layers: int, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import dsrun
    from dsrun import comm
    from dsrun.models.gpt import GPT

    comm.init_distributed(verbose=False)
    out = {}
    for name, zero in layouts(ranks).items():
        torch.manual_seed(0)
        model = GPT(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=width)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
                                     **zero}}
        engine, _, _, _ = dsrun.initialize(model=model, config=cfg)
        gen = torch.Generator().manual_seed(rank)
        for step in range(3):
            tokens = torch.randint(0, 512, (2, 65), generator=gen)
            comm.reset_comms_stats()
            loss = engine((tokens[:, :-1], tokens[:, 1:]))
            forward = comm.get_comms_group_stats()
            comm.reset_comms_stats()
            engine.backward(loss)
            engine.step()
            backward = comm.get_comms_group_stats()
        out[name] = {"parameter_bytes": engine.memory_breakdown().parameters,
                     "model_bytes": sum(p.ds_numel * 4 for p in engine.module.parameters()),
                     "forward": _traffic(forward), "backward_and_step": _traffic(backward), "loss": loss.item()}
        engine.destroy()
    if rank == 0:
        queue.put(out)
    comm.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "mics_hpz_results.json"))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args.width, args.layers, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, r in result.items():
        print(f"{name}: parameters {r['parameter_bytes']} B of {r['model_bytes']} B")
        for phase in ("forward", "backward_and_step"):
            for op, groups in r[phase].items():
                cells = ", ".join(f"[{g}] {b / 1024:.1f} KiB" for g, b in groups.items())
                print(f"  {phase:18s} {op:15s} {cells}")


if __name__ == "__main__":
    main()
