"""Step-time overhead of the monitors: dsrun's GPT trained with CSV + TensorBoard + MLflow off vs on.

Two ways to measure, because a shared machine's load swamps a 3% difference between separate runs:

``--mode interleaved`` (default). One process, one engine with every monitor configured; optimizer steps
alternate between monitors on and off (``engine.monitor.enabled`` toggled), so load from other processes
hits both alike. Reported per repeat:
  * direct: the median over adjacent (on, off) step pairs of on / off - 1 — what the step loop itself
    pays (building events, buffering them, the loss ``.item()``, sharing the interpreter with the writer);
  * writer: the writer thread's CPU time per monitored step / the unmonitored step time — the work done
    off the loop (CSV, TensorBoard, MLflow writes). On a machine with a spare core it runs in parallel;
    counting it in full is the worst case of a fully busy machine;
  * total = direct + writer.
``--mode processes``. A fresh process per configuration (``off``, ``monitors``, ``all`` = monitors +
wall_clock_breakdown + comms_logger), alternating, ``--repeats`` times; median wall time and process
CPU time per step against ``off``. Meaningful on a quiet machine.

Every measurement first waits until the monitors are up (MLflow's import and store creation happen once,
before timing), runs ``--warmup`` steps, then times ``--steps`` steps (per configuration).

    python benchmarks/monitor_overhead.py [--mode interleaved|processes] [--steps 60] [--warmup 5]
                                          [--repeats 3] [--json out.json]

Target (issue 8): with every monitor enabled, step time grows by less than 3%.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = ("off", "monitors", "all")


def ds_config(name: str, out: Path) -> dict:
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if name in ("monitors", "all"):
        config.update(csv_monitor={"enabled": True, "output_path": str(out), "job_name": "bench"},
                      tensorboard={"enabled": True, "output_path": str(out), "job_name": "bench"},
                      mlflow={"enabled": True, "tracking_uri": f"sqlite:///{out / 'mlflow.db'}",
                              "experiment_name": "bench"})
    if name == "all":
        config.update(wall_clock_breakdown=True, comms_logger={"enabled": True})
    return config


def build_engine(name: str, out: Path, width: int, layers: int, seq: int):
    """dsrun's GPT in an engine configured as ``name``, its monitors up (MLflow imported, store created)."""
    import torch

    import dsrun
    from dsrun.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=ds_config(name, out))
    engine.monitor.flush()
    return engine


def timed_step(engine, seq: int) -> float:
    """One optimizer step plus what the worker adds per step (throughput events, the loss value)."""
    import torch

    idx = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), seq + 1))
    start = time.perf_counter()
    loss = engine(idx[:, :-1], idx[:, 1:])
    engine.backward(loss)
    engine.step()
    engine.monitor.write_events([("Train/Samples/samples_per_second", 1.0, engine.global_samples),
                                 ("Train/Samples/tokens_per_second", 1.0, engine.global_samples)])
    loss.item()
    return time.perf_counter() - start


def child(name: str, steps: int, warmup: int, out: Path, width: int, layers: int, seq: int) -> dict:
    engine = build_engine(name, out, width, layers, seq)
    for _ in range(warmup):
        timed_step(engine, seq)
    cpu_start = time.process_time()
    times = [timed_step(engine, seq) for _ in range(steps)]
    cpu_per_step = (time.process_time() - cpu_start) / steps  # every thread: the writer's work counts too
    engine.monitor.close()
    return {"config": name, "median_step_s": statistics.median(times), "mean_step_s": statistics.fmean(times),
            "cpu_step_s": cpu_per_step}


def child_interleaved(steps: int, warmup: int, out: Path, width: int, layers: int, seq: int) -> dict:
    engine = build_engine("monitors", out, width, layers, seq)
    monitor = engine.monitor
    cpu_before = monitor.writer_cpu_s  # building the sinks is a one-off, not per step
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * (warmup + steps)):
        on = i % 2 == 0
        monitor.enabled = on
        elapsed = timed_step(engine, seq)
        if i >= 2 * warmup:
            times[on].append(elapsed)
    monitor.enabled = True
    monitor.flush()  # every event of the timed steps written; closing (finishing the runs) is a one-off
    writer = (monitor.writer_cpu_s - cpu_before) / steps
    monitor.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    # each monitored step against the unmonitored step right after it: the same load, so drift cancels
    direct = statistics.median(a / b for a, b in zip(times[True], times[False])) - 1
    return {"step_on_s": on, "step_off_s": off, "writer_cpu_per_step_s": writer,
            "direct": direct, "writer": writer / off, "total": direct + writer / off}


def run_interleaved(args: argparse.Namespace, env: dict) -> dict:
    results = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--child", "interleaved", "--out", tmp, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--width", str(args.width), "--layers", str(args.layers),
                   "--seq", str(args.seq)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp)
            if done.returncode != 0:
                raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"repeat {repeat + 1}: step off {r['step_off_s'] * 1e3:7.2f} ms, on {r['step_on_s'] * 1e3:7.2f} ms "
                  f"(direct {r['direct'] * 100:+.2f}%), writer {r['writer_cpu_per_step_s'] * 1e3:.3f} ms cpu/step "
                  f"({r['writer'] * 100:.2f}%), total {r['total'] * 100:+.2f}%", flush=True)
    summary = {key: statistics.median(r[key] for r in results) for key in results[0]}
    print(f"\nmedian over {args.repeats} repeats: direct {summary['direct'] * 100:+.2f}%, writer "
          f"{summary['writer'] * 100:.2f}%, total {summary['total'] * 100:+.2f}% "
          f"(step {summary['step_off_s'] * 1e3:.2f} ms without monitors)")
    return {"repeats": results, "median": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("interleaved", "processes"), default="interleaved")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "interleaved":
        print(json.dumps(child_interleaved(args.steps, args.warmup, args.out, args.width, args.layers, args.seq)))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.warmup, args.out, args.width, args.layers, args.seq)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if args.mode == "interleaved":
        summary = run_interleaved(args, env)
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary},
                                            indent=2) + "\n")
        return 0

    configs = args.configs.split(",")
    runs: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in configs}
    for repeat in range(args.repeats):
        for name in configs:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, __file__, "--child", name, "--out", tmp, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--width", str(args.width), "--layers", str(args.layers),
                       "--seq", str(args.seq)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp)
                if done.returncode != 0:
                    print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
                    return 1
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs[name]["wall"].append(result["median_step_s"])
                runs[name]["cpu"].append(result["cpu_step_s"])
                print(f"repeat {repeat + 1}: {name:<9} median step {result['median_step_s'] * 1e3:8.2f} ms wall, "
                      f"{result['cpu_step_s'] * 1e3:8.2f} ms cpu", flush=True)
    base = {kind: statistics.median(runs[configs[0]][kind]) for kind in ("wall", "cpu")}
    summary = {}
    print(f"\n{'config':<10}{'wall ms':>10}{'vs off':>9}{'cpu ms':>10}{'vs off':>9}")
    for name in configs:
        wall, cpu = statistics.median(runs[name]["wall"]), statistics.median(runs[name]["cpu"])
        summary[name] = {"median_step_ms": wall * 1e3, "cpu_step_ms": cpu * 1e3,
                         "wall_overhead": wall / base["wall"] - 1, "cpu_overhead": cpu / base["cpu"] - 1,
                         "runs": runs[name]}
        print(f"{name:<10}{wall * 1e3:>10.2f}{(wall / base['wall'] - 1) * 100:>8.2f}%"
              f"{cpu * 1e3:>10.2f}{(cpu / base['cpu'] - 1) * 100:>8.2f}%")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": summary},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
