"""Domino's overlap against the same tensor-parallel Transformer with every all-reduce waited for at once.

2 gloo ranks on the CPU, TP=2, one DominoTransformer (``--layers`` layers of width ``--hidden``, ``--heads``
heads, MLP 4x, sequence ``--seq``, batch ``--batch`` cut in two halves by Domino), fp32. Three schedules of the
same weights and inputs, alternating within each repeat:

* ``inter``: Domino's default (``domino_intra_layer_overlap`` false): reductions overlap across layer ends;
* ``intra``: ``domino_intra_layer_overlap`` true;
* ``sync`` (the baseline): the same model and order, but every all-reduce, forward and backward, is waited for
  where it starts (``dsrun.tensor_parallel.domino``'s collectives replaced by synchronous ones for this run).

Each rank times forward + backward (the slowest rank's wall time per step); the ratio is the median over
repeats of each schedule's median step over ``sync``'s in the same repeat. ::

    python benchmarks/domino.py [--json OUT] [--repeats 3] [--steps 6] [--hidden 1024] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Done:
    def wait(self):
        return None


class _SyncComm:
    """``dsrun.comm`` with asynchronous all-reduces made synchronous (the baseline)."""

    def __init__(self, real):
        self.real = real

    def all_reduce(self, tensor, group=None, async_op=False):
        self.real.all_reduce(tensor, group=group)
        return _Done()

    def __getattr__(self, name):
        return getattr(self.real, name)


class _Mpu:
    def get_tensor_model_parallel_world_size(self):
        return 2

    def get_tensor_model_parallel_group(self):
        return None


def _rank(rank: int, args: argparse.Namespace, port: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    from dsrun import comm
    from dsrun.tensor_parallel.domino import async_linear, transformer
    from dsrun.tensor_parallel.domino.transformer import DominoTransformer

    comm.init_distributed(dist_backend="gloo")
    real = comm

    def build(intra: bool):
        torch.manual_seed(0)
        cfg = SimpleNamespace(hidden_size=args.hidden, num_attention_heads=args.heads,
                              kv_channels=args.hidden // args.heads, ffn_hidden_size=4 * args.hidden,
                              num_layers=args.layers, layernorm_epsilon=1e-5, hidden_dropout=0.0,
                              attention_dropout=0.0, add_bias_linear=True,
                              apply_residual_connection_post_layernorm=False, params_dtype=torch.float32,
                              perform_initialization=True, init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
                              output_layer_init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
                              gated_linear_unit=False, domino_intra_layer_overlap=intra)
        return DominoTransformer(cfg, _Mpu(), None, None)

    models = {"inter": build(False), "intra": build(True), "sync": build(False)}
    x = torch.randn(args.seq, args.batch, args.hidden, generator=torch.Generator().manual_seed(1))
    times = {}
    for repeat in range(args.repeats):
        order = list(models) if repeat % 2 == 0 else list(reversed(models))
        for name in order:
            shim = _SyncComm(real) if name == "sync" else real
            async_linear.comm = transformer.comm = shim
            steps = []
            for step in range(args.warmup + args.steps):
                comm.barrier()
                start = time.perf_counter()
                models[name](x.clone().requires_grad_(), None).sum().backward()
                elapsed = torch.tensor([time.perf_counter() - start])
                real.all_reduce(elapsed, op=comm.ReduceOp.MAX)
                if step >= args.warmup:
                    steps.append(float(elapsed))
            times.setdefault(name, []).append(statistics.median(steps))
    async_linear.comm = transformer.comm = real
    if rank == 0:
        out.put(times)
    comm.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args()
    from tests.helpers import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    times = out.get(timeout=3600)
    for p in procs:
        p.join(timeout=60)
    ratios = {name: statistics.median(t / s for t, s in zip(times[name], times["sync"])) for name in ("inter", "intra")}
    load = os.getloadavg()[0]
    print(f"Domino TP=2 on 2 gloo ranks, {args.layers} layers x {args.hidden}, seq {args.seq}, batch {args.batch}, "
          f"{args.threads} thread(s)/rank, load {load:.1f}")
    for name in ("inter", "intra", "sync"):
        print(f"  {name:<6} median step {statistics.median(times[name]) * 1e3:8.1f} ms"
              + (f"   {ratios[name]:.3f}x of sync" if name in ratios else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"ratio_vs_sync": ratios, "step_s": times, "load": load,
                                               "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
