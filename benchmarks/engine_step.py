"""Step time of dsrun's ZeRO stages 0-3 against torch DistributedDataParallel.

Two gloo ranks on this machine train the same ~20M-parameter GPT on the same batch with AdamW; each
configuration keeps its own model copy, and the configurations take turns step by step (round robin), so
load from other processes hits them alike. A step's time is the slowest rank's forward + backward +
optimizer step; the table reports medians over the measured steps.

    python benchmarks/engine_step.py [--steps 8] [--warmup 2] [--layers 6] [--width 512] [--json out.json]

Targets (issue 3): stage 0 <= 1.05x DDP, stages 1-2 <= 1.15x DDP. Issue 4: stage 3 <= 1.4x DDP, with and
without ``stage3_prefetch_bucket_size`` (prefetch on uses DeepSpeed's default 5e7 elements), with
DeepSpeed's default ``stage3_max_reuse_distance`` and with 0.

``--zero3-gather`` compares only stage 3's parameter gathers instead (reuse distance 0, so backward gathers
again): ``stage3_allgather_sequential`` true (one all-gather per parameter) against false (DeepSpeed's
default: one per fetch) and ``stage3_use_all_reduce_for_fetch_params``. The CPU column is each rank's process
time in the step, the mean over ranks.
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


def build_gpt(vocab: int, seq: int, width: int, layers: int, heads: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, tokens):
            x = self.wte(tokens[:, :-1]) + self.wpe(torch.arange(tokens.shape[1] - 1))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    torch.manual_seed(0)
    return GPT()


def rank_main(rank: int, world: int, port: int, opts: dict, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(opts["threads"])
    import dsrun
    from dsrun import comm

    dsrun.init_distributed(verbose=False)
    make = lambda: build_gpt(opts["vocab"], opts["seq"], opts["width"], opts["layers"], opts["heads"])  # noqa: E731
    numel = sum(p.numel() for p in {id(p): p for p in make().parameters()}.values())
    bucket = opts["bucket_elements"]
    runners = {}

    ddp_model = torch.nn.parallel.DistributedDataParallel(make(), bucket_cap_mb=bucket * 4 / 2**20)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-4)

    def ddp_step(tokens):
        loss = ddp_model(tokens)
        ddp_opt.zero_grad(set_to_none=False)
        loss.backward()
        ddp_opt.step()

    runners["torch DDP"] = ddp_step
    engines = {}
    # stage 3 with DeepSpeed's defaults (prefetch 5e7 elements; reuse distance 1e9, which keeps every
    # parameter gathered from forward to backward) and with reuse distance 0 (the textbook ZeRO-3: gathered
    # again in backward), each with prefetch on and off
    no_prefetch, no_reuse = {"stage3_prefetch_bucket_size": 0}, {"stage3_max_reuse_distance": 0}
    variants = [(0, "", {}), (1, "", {}), (2, "", {}), (3, "", {}), (3, " no prefetch", no_prefetch),
                (3, " reuse 0", no_reuse), (3, " reuse 0, no prefetch", {**no_reuse, **no_prefetch})]
    if opts["zero3_gather"]:
        variants = [(3, " sequential gathers", {**no_reuse, "stage3_allgather_sequential": True}),
                    (3, " coalesced gathers", no_reuse),
                    (3, " all-reduce fetch", {**no_reuse, "stage3_use_all_reduce_for_fetch_params": True})]
    for stage, label, extra in variants:
        # gradient_clipping 0: DDP's loop does not clip (dsrun, as DeepSpeed 0.19, clips at 1.0 when left out)
        cfg = {"train_micro_batch_size_per_gpu": opts["micro"], "steps_per_print": 10**6, "gradient_clipping": 0.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": not opts["compiled_adam"]}},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                     "overlap_comm": True, **extra}}
        engine = dsrun.initialize(model=make(), config=cfg)[0]
        engines[f"{stage}{label}"] = engine

        def step(tokens, engine=engine):
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()

        runners[f"dsrun stage {stage}{label}"] = step

    gen = torch.Generator().manual_seed(rank)
    times = {name: [] for name in runners}
    cpu = {name: [] for name in runners}
    comm_bytes = {}
    for it in range(opts["warmup"] + opts["steps"]):
        tokens = torch.randint(0, opts["vocab"], (opts["micro"], opts["seq"]), generator=gen)
        for name, run in runners.items():
            comm.barrier()
            before = comm.comms_logger.total_traffic_bytes()
            start, start_cpu = time.perf_counter(), time.process_time()
            run(tokens)
            elapsed = torch.tensor([time.perf_counter() - start])
            used = torch.tensor([time.process_time() - start_cpu])
            comm.all_reduce(used)
            if name.startswith("dsrun"):  # DDP calls torch.distributed itself; the logger does not see it
                comm_bytes[name] = comm.comms_logger.total_traffic_bytes() - before
            comm.all_reduce(elapsed, op=comm.ReduceOp.MAX)
            if it >= opts["warmup"]:
                times[name].append(float(elapsed))
                cpu[name].append(float(used) / 2)
    memory = {f"dsrun stage {s}": e.memory_breakdown().as_dict() for s, e in engines.items()}
    if rank == 0:
        queue.put({"times": times, "cpu": cpu, "numel": numel, "comm_bytes": comm_bytes, "memory": memory})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--bucket-elements", type=int, default=int(25 * 2**20 / 4),
                        help="gradient bucket size in elements (default: DDP's 25 MiB of fp32)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--compiled-adam", action="store_true",
                        help="let dsrun use DeepSpeedCPUAdam when built (default: torch's AdamW, as DDP uses)")
    parser.add_argument("--zero3-gather", action="store_true",
                        help="only stage 3, sequential vs coalesced vs all-reduce parameter gathers")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    opts = {k: getattr(args, k) for k in ("steps", "warmup", "layers", "width", "heads", "vocab", "seq", "micro",
                                          "bucket_elements", "threads", "compiled_adam", "zero3_gather")}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from dsrun.utils.net import free_port

    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, opts, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=3600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    base = statistics.median(result["times"]["torch DDP"])
    if args.compiled_adam:
        print("dsrun optimizer: AdamW through DeepSpeedCPUAdam when built; DDP: torch.optim.AdamW")
    print(f"GPT {result['numel'] / 1e6:.1f}M params, 2 gloo ranks x {args.threads} thread(s), micro-batch "
          f"{args.micro} x {args.seq} tokens, {args.steps} measured steps (median); load avg "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'config':<36}{'median ms':>12}{'min ms':>10}{'CPU ms':>9}{'vs DDP':>9}{'comm MB/step/rank':>20}")
    rows = {}
    for name, values in result["times"].items():
        med, cpu = statistics.median(values), statistics.median(result["cpu"][name])
        comm_mb = result["comm_bytes"].get(name)
        rows[name] = {"median_s": med, "min_s": min(values), "cpu_s": cpu, "ratio": med / base, "comm_bytes": comm_mb}
        print(f"{name:<36}{med * 1e3:>12.1f}{min(values) * 1e3:>10.1f}{cpu * 1e3:>9.1f}{med / base:>8.2f}x"
              f"{(f'{comm_mb / 2**20:.1f}' if comm_mb is not None else '-'):>20}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "numel": result["numel"], "memory": result["memory"],
                                         "options": opts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
