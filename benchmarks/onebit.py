"""1-bit Adam, 0/1 Adam and 1-bit LAMB against Adam and LAMB on 2 CPU ranks: bytes, rounds and step time,
the step time a 1 Gbit/s link would give, and convergence on the gpt_onebit recipe.

    PYTHONPATH=. python benchmarks/onebit.py traffic [--steps 30] [--warmup 10] [--json out.json]
    PYTHONPATH=. python benchmarks/onebit.py convergence [--steps 600] [--freeze 100] [--precisions fp32 bf16]
                                                         [--runs Adam "1-bit Adam" ...] [--adam-lr 6e-3]
                                                         [--lamb-lr 1e-2] [--out DIR]

**traffic**: the recipe's model (gpt-nano, 372,576 parameters) on random bytes, micro-batch 16 per rank.
Every optimizer keeps its own model copy in the same two processes and they take turns step by step, so load
from other processes hits them alike. The 1-bit ones warm up for ``--warmup`` steps; the table shows, per
optimizer step, the comms logger's bytes sent by a rank (in warm-up and after it), the collectives issued,
the measured step time (slowest rank, median over the steps after warm-up) and the time spent inside
collectives, and an alpha-beta model of the same step on a 1 Gbit/s link: its communication ``sum over
collectives (steps * ALPHA) + bytes / BETA`` and the whole step, compute + that, where compute = measured step time - time inside collectives, ALPHA = 50 us
per message step (a ring all-reduce on N ranks takes 2(N-1) steps, the other collectives N-1) and BETA =
125e6 bytes/s.

**convergence**: ``dsrun train +recipe=gpt_onebit`` (gpt-nano on the Python-stdlib bytes, 2 ranks, WarmupCosine
LR) for every optimizer and precision, ``--steps`` steps with the warm-up ending at ``--freeze``, one peak lr
for the Adam family (``--adam-lr``) and one for the LAMB family (``--lamb-lr``), the same for a compressed
optimizer and its baseline (the defaults were chosen by the baselines' loss in 200-step runs); the final
mean training loss over the last 100 steps against the baseline's (Adam for the Adam family, dsrun's ``Lamb``,
one trust ratio per parameter tensor as DeepSpeed's FusedLamb, for 1-bit LAMB), and the run's total bytes sent
by rank 0 (comms.json) against the baseline's.
Each run takes a few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ALPHA, BETA = 50e-6, 1e9 / 8
GPT_NANO = dict(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_embd=96, dropout=0.0, bias=True,
                tie_embeddings=True)
COMMON = dict(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
LAMB_COMMON = dict(lr=1e-3, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.01)
# convergence: the peak lr of the Adam family and of the LAMB family, chosen by the baselines' (Adam's,
# LAMB's) loss in 200-step runs (docs/onebit.md)
ADAM_LR, LAMB_LR = 6e-3, 3e-2


def traffic_optimizers(warmup: int) -> dict[str, dict]:
    return {
        "Adam": {"type": "AdamW", "params": COMMON},
        "1-bit Adam": {"type": "OneBitAdam", "params": {**COMMON, "freeze_step": warmup}},
        "0/1 Adam": {"type": "ZeroOneAdam", "params": {**COMMON, "var_freeze_step": warmup, "local_step_scaler": 4}},
        "LAMB": {"type": "Lamb", "params": LAMB_COMMON},
        "1-bit LAMB": {"type": "OneBitLamb", "params": {**LAMB_COMMON, "freeze_step": warmup}},
    }


def _steps_per_call(op: str, world: int) -> int:
    return 2 * (world - 1) if op == "all_reduce" else world - 1


def rank_main(rank: int, world: int, port: int, opts: dict, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import dsrun
    from dsrun import comm
    from dsrun.models.gpt import GPT

    comm.init_distributed(verbose=False)
    engines = {}
    for name, optimizer in traffic_optimizers(opts["warmup"]).items():
        torch.manual_seed(1234)
        model = GPT(**GPT_NANO)
        config = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10 ** 6, "gradient_clipping": 1.0,
                  "optimizer": optimizer, "zero_optimization": {"stage": 0}, "comms_logger": {"enabled": True}}
        engines[name], _, _, _ = dsrun.initialize(model=model, config=config)
    records: dict[str, list] = {name: [] for name in engines}
    gen = torch.Generator().manual_seed(rank)
    for step in range(opts["steps"]):
        tokens = torch.randint(0, 256, (16, 129), generator=gen)
        for name, engine in engines.items():  # round robin
            before = comm.get_comms_stats()  # (the engines share the process's comms logger)
            start = time.perf_counter()
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            elapsed = time.perf_counter() - start
            stats = {op: {k: v - before.get(op, {}).get(k, 0) for k, v in totals.items()}
                     for op, totals in comm.get_comms_stats().items()}
            records[name].append({"time": elapsed, "bytes": sum(s["traffic_bytes"] for s in stats.values()),
                                  "calls": sum(s["count"] for s in stats.values()),
                                  "message_steps": sum(s["count"] * _steps_per_call(op, world) for op, s in stats.items()),
                                  "comm_time": sum(s["latency_s"] for s in stats.values())})
    times = torch.tensor([[r["time"] for r in rows] for rows in records.values()], dtype=torch.float64)
    comm.all_reduce(times, op=comm.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    for i, rows in enumerate(records.values()):
        for row, slowest in zip(rows, times[i].tolist()):
            row["time"] = slowest
    if rank == 0:
        queue.put({"params": sum(p.numel() for p in next(iter(engines.values())).module.parameters()),
                   "records": records})
    comm.destroy_process_group()


def traffic(args: argparse.Namespace) -> dict:
    from dsrun.utils.net import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    opts = {"steps": args.steps, "warmup": args.warmup}
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, opts, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join(timeout=60)
    fp32_allreduce = 2 * (2 - 1) / 2 * 4 * result["params"]
    rows = {}
    for name, records in result["records"].items():
        warm, after = records[:args.warmup], records[args.warmup + 1:]  # the first compressed step gathers once
        time_med = statistics.median(r["time"] for r in after)
        comm_med = statistics.median(r["comm_time"] for r in after)
        bytes_after = statistics.mean(r["bytes"] for r in after)
        steps_after = statistics.mean(r["message_steps"] for r in after)
        link = steps_after * ALPHA + bytes_after / BETA
        modelled = (time_med - comm_med) + link
        rows[name] = {"bytes_warmup": statistics.mean(r["bytes"] for r in warm), "bytes_after": bytes_after,
                      "ratio_to_fp32_allreduce": bytes_after / fp32_allreduce,
                      "calls_after": statistics.mean(r["calls"] for r in after),
                      "rounds_after": sum(r["bytes"] > 1024 for r in after) / len(after),
                      "step_ms": 1e3 * time_med, "comm_ms": 1e3 * comm_med, "comm_ms_1gbps": 1e3 * link,
                      "step_ms_1gbps": 1e3 * modelled}
    base = rows["Adam"]["step_ms_1gbps"]
    print(f"{result['params']:,} parameters, 2 ranks, {args.steps} steps ({args.warmup} of warm-up); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'optimizer':<11} {'bytes/step warm-up':>18} {'after':>9} {'vs fp32 AR':>10} {'rounds':>6} "
          f"{'step ms':>8} {'in comm':>8} {'1 Gbit/s: comm ms':>17} {'step ms':>8} {'speed-up':>8}")
    for name, r in rows.items():
        print(f"{name:<11} {r['bytes_warmup']:>18,.0f} {r['bytes_after']:>9,.0f} 1/{1 / r['ratio_to_fp32_allreduce']:>8.1f} "
              f"{r['rounds_after']:>6.2f} {r['step_ms']:>8.1f} {r['comm_ms']:>8.1f} {r['comm_ms_1gbps']:>17.2f} "
              f"{r['step_ms_1gbps']:>8.1f} "
              f"{base / r['step_ms_1gbps']:>7.2f}x")
    return {"params": result["params"], "rows": rows, "load": os.getloadavg()[0]}


# --- convergence ----------------------------------------------------------------------------------------
def convergence_runs(freeze: int, adam_lr: float = ADAM_LR, lamb_lr: float = LAMB_LR) -> dict[str, list[str]]:
    """Each run's overrides: one lr for the Adam family and one for the LAMB family, passed to every run."""
    adam, lamb = f"optimizer.params.lr={adam_lr:g}", f"optimizer.params.lr={lamb_lr:g}"
    return {
        "Adam": ["optimizer=adamw", adam],
        "1-bit Adam": ["optimizer=onebit_adam", adam, f"optimizer.params.freeze_step={freeze}"],
        "0/1 Adam": ["optimizer=zero_one_adam", adam, f"optimizer.params.var_freeze_step={freeze}"],
        "LAMB": ["optimizer=lamb", lamb],
        "1-bit LAMB": ["optimizer=onebit_lamb", lamb, f"optimizer.params.freeze_step={freeze}"],
    }


BASELINES = {"1-bit Adam": ["Adam"], "0/1 Adam": ["Adam"], "1-bit LAMB": ["LAMB"]}
BOUNDS = {"1-bit Adam": 0.02, "0/1 Adam": 0.03, "1-bit LAMB": 0.02}


def train(overrides: list[str], out: Path) -> dict:
    if (out / "metrics.json").exists() and (out / "comms.json").exists():  # finished before (--out): read it
        return _figures(out, wall_s=float("nan"))
    env = {**os.environ, "DSRUN_MLFLOW": "false", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "dsrun", "train", "+recipe=gpt_onebit", f"hydra.run.dir={out}",
           "train.eval_interval=0", *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return _figures(out, wall_s=time.perf_counter() - start)


def _figures(out: Path, wall_s: float) -> dict:
    losses = json.loads((out / "metrics.json").read_text())["train_losses"]
    comms = json.loads((out / "comms.json").read_text())
    total = sum(op["traffic_bytes"] for op in comms["ops"].values())
    # every compressed exchange is one all_to_all_single (phase 1) and one all_gather (phase 2)
    exchanges = comms["ops"].get("all_to_all_single", {}).get("count", 0)
    return {"final": statistics.mean(losses[-100:]), "bytes": total, "exchanges": exchanges, "wall_s": wall_s}


def convergence(args: argparse.Namespace) -> dict:
    root = args.out or Path(tempfile.mkdtemp(prefix="dsrun-onebit-bench-"))
    results: dict[str, dict] = {}
    for precision in args.precisions:
        for name, overrides in convergence_runs(args.freeze, args.adam_lr, args.lamb_lr).items():
            if args.runs and name not in args.runs:
                continue
            lr = args.lamb_lr if "LAMB" in name else args.adam_lr
            folder = f"{precision}-{re.sub(r'[^A-Za-z0-9_-]', '', name.replace(' ', '_'))}-{args.steps}-{args.freeze}-lr{lr:g}"
            run = train([*overrides, f"precision={precision}", f"train.max_steps={args.steps}"], root / folder)
            results[f"{precision}/{name}"] = run
            took = f"({run['wall_s']:.0f} s)" if run["wall_s"] == run["wall_s"] else "(read from --out)"
            print(f"{precision:<5} {name:<18} final loss {run['final']:.4f}  bytes {run['bytes']:,.0f}  "
                  f"compressed exchanges {run['exchanges']}  {took}", flush=True)
    print(f"\n{args.steps} steps, warm-up {args.freeze}, lr {args.adam_lr:g} (Adam family) and {args.lamb_lr:g} "
          "(LAMB family); final = mean training loss of the last 100 steps; "
          f"load average {os.getloadavg()[0]:.1f}")
    verdicts = {}
    for precision in args.precisions:
        for name, bases in BASELINES.items():
            mine = results.get(f"{precision}/{name}")
            for base in bases:
                ref = results.get(f"{precision}/{base}")
                if mine is None or ref is None:
                    continue
                gap = (mine["final"] - ref["final"]) / ref["final"]
                verdicts[f"{precision}/{name} vs {base}"] = gap
                print(f"{precision:<5} {name:<11} vs {base:<18} loss {gap:+.2%} (bound +{BOUNDS[name]:.0%}), "
                      f"bytes 1/{ref['bytes'] / mine['bytes']:.1f}")
    return {"runs": results, "gaps": verdicts, "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("traffic")
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--warmup", type=int, default=10)
    c = sub.add_parser("convergence")
    c.add_argument("--steps", type=int, default=600)
    c.add_argument("--freeze", type=int, default=100)
    c.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    c.add_argument("--adam-lr", type=float, default=ADAM_LR, help="the peak lr of Adam, 1-bit Adam and 0/1 Adam")
    c.add_argument("--lamb-lr", type=float, default=LAMB_LR, help="the peak lr of LAMB and 1-bit LAMB")
    c.add_argument("--runs", nargs="+", default=None, choices=list(convergence_runs(0)),
                   help="only these runs (default: all five); a comparison needs both of its runs")
    c.add_argument("--out", type=Path, default=None,
                   help="the runs' folder (default: a new temporary one); a run finished there before is read, "
                        "not repeated, so an interrupted benchmark goes on where it stopped")
    for p in (t, c):
        p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    result = traffic(args) if args.what == "traffic" else convergence(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
