"""The hybrid engine's generate at ZeRO-3 on two gloo ranks: gathers, bytes and time per ``generate`` call.

A Hugging Face GPT-2 built from its config (6 blocks, width 256, 8 heads, a 2048-token vocabulary) is trained by a
``DeepSpeedHybridEngine`` at ZeRO-3 (nothing persisted whole) on each of two ranks, which then generate 32 greedy
tokens after a 16-token prompt for a batch of 4, three ways: ``pin_parameters`` (every parameter gathered once per
call), ``pin_parameters: false`` (each layer gathered by its hooks at every forward) and ``inference_tp_size: 2``
(the blocks gathered 2 at a time and split over the two ranks, which generate both ranks' prompts together).
Reported per call: all-gathers and their bytes (the comms logger, rank 0), the median wall time of 3 calls and the
process CPU time of rank 0, and whether the tokens equal the whole model's ``generate``.

    python benchmarks/hybrid_engine.py [--json benchmarks/hybrid_engine_results.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ranks import rank_env, run_ranks  # noqa: E402

MODES = {"pinned": {}, "unpinned": {"pin_parameters": False}, "tp2": {"inference_tp_size": 2,
                                                                      "tp_gather_partition_size": 2}}
BATCH, PROMPT, NEW, REPEATS = 4, 16, 32, 3


def rank_main(rank: int, world: int, port: int, queue, threads: int) -> None:
    rank_env(rank, world, port)
    import torch
    import transformers as t

    torch.set_num_threads(threads)
    import dsrun
    from dsrun import comm

    dsrun.init_distributed(verbose=False)
    results = {}
    for mode, hybrid in MODES.items():
        torch.manual_seed(0)
        model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=6, n_embd=256, n_head=8, vocab_size=2048, n_positions=128,
                                               bos_token_id=0, eos_token_id=0, pad_token_id=0))
        whole = copy.deepcopy(model).eval()
        config = {"train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "hybrid_engine": {"enabled": True, "max_out_tokens": PROMPT + NEW, **hybrid}}
        engine, *_ = dsrun.initialize(model=model, config=config)
        ids = torch.randint(1, 2048, (BATCH, PROMPT), generator=torch.Generator().manual_seed(rank))
        want = whole.generate(ids, max_new_tokens=NEW, do_sample=False)
        engine.eval()
        walls, cpus = [], []
        for _ in range(REPEATS):
            comm.reset_comms_stats()
            wall, cpu = time.perf_counter(), time.process_time()
            got = engine.generate(ids, max_new_tokens=NEW, do_sample=False)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            stats = comm.get_comms_stats().get("all_gather", {})
        results[mode] = {"all_gathers": int(stats.get("count", 0)), "all_gather_mb": stats.get("message_bytes", 0)
                         / 2**20, "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
                         "same_tokens": bool(torch.equal(got, want)),
                         "workspace_kib": engine.hybrid.workspace_bytes() / 1024}
        engine.destroy()
    if rank == 0:
        queue.put(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    results = run_ranks(rank_main, 2, args.threads, results=1, timeout=1200)[0]
    print(f"{'mode':10} {'all-gathers':>11} {'MiB':>8} {'wall s':>7} {'cpu s':>6} {'same tokens':>11}")
    for mode, r in results.items():
        print(f"{mode:10} {r['all_gathers']:>11} {r['all_gather_mb']:>8.2f} {r['wall_s']:>7.2f} {r['cpu_s']:>6.2f} "
              f"{str(r['same_tokens']):>11}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
