"""dsrun against the real DeepSpeed: the same model, config and data, ZeRO stages 0-3, per-stage step ratios.

Two gloo ranks on the CPU train the same 4-layer GPT (width 384, tied embedding and head) with the same
DeepSpeed config; only the import differs: ``import dsrun as deepspeed`` or ``import deepspeed``. The worker
code is one function for both. A step's time is the slowest rank's forward + backward + optimizer step
(barrier before, max over ranks after); a run's figure is the median of its measured steps. Two figures
that a loaded machine disturbs less are printed beside it: the CPU time a rank spends in the step (its
process time, mean over ranks) and the minor page faults it takes (fresh memory touched for the first
time: a count, the same on any load). Each rank's peak RSS over its run is recorded too (``peak_rss``).

The ranks' machinery (:func:`run_once` -> :func:`worker` -> :func:`rank_main`) times any framework whose step
builder it can import: ``"module:function"`` names one in another benchmark (``benchmarks/vs_fsdp.py`` times
PyTorch's FSDP2 this way), and ``opts["world"]`` sets the number of ranks (2 by default).

Runs alternate between the two frameworks stage by stage (A B, then B A on the next repeat), each run a
fresh pair of rank processes, so slow drift of the machine's load hits both alike. The ratio of a stage is
the median over repeats of (dsrun's median / DeepSpeed's median from the same repeat). The load average is
printed before and after.

DeepSpeed is not a dependency of dsrun. Install it in a side environment that sees the installed torch and
point the benchmark at its interpreter (``--deepspeed-python`` or ``DSRUN_DEEPSPEED_PYTHON``)::

    python -m venv --system-site-packages /path/dsvenv
    echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > /path/constraints.txt
    /path/dsvenv/bin/pip install wheel setuptools -c /path/constraints.txt
    DS_BUILD_OPS=0 /path/dsvenv/bin/pip install deepspeed --no-build-isolation -c /path/constraints.txt

    DSRUN_DEEPSPEED_PYTHON=/path/dsvenv/bin/python python benchmarks/vs_deepspeed.py [--stages 0 1 2 3]
        [--repeats 5] [--steps 30] [--warmup 3] [--json out.json]

The optimizer is torch's AdamW in both (``"torch_adam": true``) by default, so the comparison is of the
engines, not of Adam kernels; ``--native-adam`` lets each use its own CPU Adam instead.
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
DS_PYTHON_ENV = "DSRUN_DEEPSPEED_PYTHON"


# ------------------------------------------------------------------------------------------ the workload
from engine_step import build_gpt  # noqa: E402  (benchmarks/ is the script's folder; stdlib-only import)


def ds_config(stage: int, opts: dict) -> dict:
    """The one DeepSpeed config both engines get (everything not named here: DeepSpeed's defaults)."""
    params = {"lr": 1e-4}
    if not opts["native_adam"]:
        params["torch_adam"] = True
    cfg = {"train_micro_batch_size_per_gpu": opts["micro"], "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": params},
           "zero_optimization": {"stage": stage}}
    if opts["bf16"]:
        cfg["bf16"] = {"enabled": True}
    return cfg


def build_engine_step(framework: str, stage: int, opts: dict):
    """dsrun's or DeepSpeed's engine (``framework``) on the benchmark GPT at ZeRO ``stage``: returns a function
    that runs one training step on a batch of tokens and returns its loss."""
    if framework == "dsrun":
        sys.path.insert(0, str(REPO))
        import dsrun as deepspeed
    else:
        import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_gpt(opts["vocab"], opts["seq"], opts["width"], opts["layers"], opts["heads"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage, opts))

    def step(tokens):
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        return loss
    return step


def step_builder(framework: str):
    """The function that builds ``framework``'s step: dsrun's and DeepSpeed's here; another benchmark's as
    ``"module:function"`` (a module in benchmarks/, called with the same arguments: vs_fsdp.py's FSDP)."""
    if ":" not in framework:
        return build_engine_step
    import importlib

    module, _, function = framework.partition(":")
    return getattr(importlib.import_module(module), function)


def rank_main(rank: int, world: int, port: int, framework: str, stage: int, opts: dict, out: str) -> None:
    """One rank: build ``framework``'s step (:func:`step_builder`), time ``steps`` steps; rank 0 writes the
    times, losses, CPU times, page faults and every rank's peak RSS."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(opts["threads"]))
    import torch

    torch.set_num_threads(opts["threads"])
    step = step_builder(framework)(framework, stage, opts)
    import resource

    import torch.distributed as dist

    gen = torch.Generator().manual_seed(rank)
    times, losses, cpu, faults = [], [], [], []
    for it in range(opts["warmup"] + opts["steps"]):
        tokens = torch.randint(0, opts["vocab"], (opts["micro"], opts["seq"]), generator=gen)
        dist.barrier()
        faults0, cpu0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        start = time.perf_counter()
        loss = step(tokens)
        elapsed = torch.tensor([time.perf_counter() - start])
        work = torch.tensor([time.process_time() - cpu0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0],
                            dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(work)  # summed over ranks, divided below
        losses.append(float(loss))
        if it >= opts["warmup"]:
            times.append(float(elapsed))
            cpu.append(float(work[0]) / world)
            faults.append(float(work[1]) / world)
    peak = torch.zeros(world, dtype=torch.float64)  # each rank's peak resident set (ru_maxrss: KiB on Linux)
    peak[rank] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    dist.all_reduce(peak)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "losses": losses, "cpu": cpu, "faults": faults,
                                         "peak_rss": peak.tolist()}))
    dist.barrier()
    # leave without the interpreter's teardown, which is not measured: DeepSpeed 0.19.8's ranks at stages 1-3
    # abort in it on torch 2.13 ("terminate called without an active exception"), after the results are written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker(framework: str, stage: int, opts: dict, out: str) -> None:
    """Spawn the ranks of one run (called in the framework's own interpreter)."""
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO))
    from dsrun.utils.net import free_port

    world = int(opts.get("world", 2))
    mp.start_processes(rank_main, args=(world, free_port(), framework, stage, opts, out), nprocs=world, join=True,
                       start_method="spawn")


# ------------------------------------------------------------------------------------------ the driver
def run_once(python: str, framework: str, stage: int, opts: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": str(opts["threads"])}
        cmd = [python, str(Path(__file__).resolve()), "--worker", framework, str(stage), json.dumps(opts), out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"{framework} stage {stage} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(Path(out).read_text())


def find_deepspeed_python(given: str | None) -> str:
    python = given or os.environ.get(DS_PYTHON_ENV)
    if not python:
        sys.exit(f"vs_deepspeed: no DeepSpeed interpreter: pass --deepspeed-python or set {DS_PYTHON_ENV} "
                 "(see this script's docstring for installing DeepSpeed in a side environment)")
    probe = subprocess.run([python, "-c", "import deepspeed, torch; print(deepspeed.__version__, torch.__version__)"],
                           capture_output=True, text=True, timeout=600)
    if probe.returncode != 0:
        sys.exit(f"vs_deepspeed: '{python}' cannot import deepspeed: {probe.stderr.strip().splitlines()[-1:]}")
    return python


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], int(argv[2]), json.loads(argv[3]), argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-python", default=None, help=f"interpreter with deepspeed (or ${DS_PYTHON_ENV})")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--native-adam", action="store_true", help="each engine's own CPU Adam, not torch's AdamW")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    ds_python = find_deepspeed_python(args.deepspeed_python)
    opts = {k: getattr(args, k) for k in ("steps", "warmup", "layers", "width", "heads", "vocab", "seq", "micro",
                                          "threads", "bf16", "native_adam")}
    pythons = {"dsrun": sys.executable, "deepspeed": ds_python}
    load_before = os.getloadavg()
    runs: dict[int, dict[str, list[dict]]] = {s: {"dsrun": [], "deepspeed": []} for s in args.stages}
    started = time.time()
    for r in range(args.repeats):
        for stage in args.stages:
            order = ["dsrun", "deepspeed"] if r % 2 == 0 else ["deepspeed", "dsrun"]
            for framework in order:
                result = run_once(pythons[framework], framework, stage, opts, args.timeout)
                result["median"] = statistics.median(result["times"])
                result["cpu_median"] = statistics.median(result["cpu"])
                result["faults_median"] = statistics.median(result["faults"])
                runs[stage][framework].append(result)
                print(f"repeat {r} stage {stage} {framework:<9} median {result['median'] * 1e3:7.1f} ms  cpu "
                      f"{result['cpu_median'] * 1e3:7.1f} ms  faults {result['faults_median']:8.0f}  "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    load_after = os.getloadavg()
    print(f"\nGPT {args.layers} layers x {args.width}, 2 gloo ranks x {args.threads} thread(s), micro-batch "
          f"{args.micro} x {args.seq} tokens, {'bf16' if args.bf16 else 'fp32'}, "
          f"{'native' if args.native_adam else 'torch'} AdamW; {args.steps} steps per run, {args.repeats} "
          f"alternating repeats; {time.time() - started:.0f} s; load avg {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after, on {os.cpu_count()} cores")
    print(f"{'stage':<7}{'dsrun ms':>10}{'DeepSpeed ms':>14}{'ratio (median of pairs)':>26}{'cpu ratio':>11}"
          f"{'faults dsrun/DS':>18}{'pair ratios':>30}")
    table = {}
    for stage in args.stages:
        mine = [x["median"] for x in runs[stage]["dsrun"]]
        theirs = [x["median"] for x in runs[stage]["deepspeed"]]
        pairs = [a / b for a, b in zip(mine, theirs)]
        cpu_pairs = [a["cpu_median"] / b["cpu_median"] for a, b in zip(runs[stage]["dsrun"], runs[stage]["deepspeed"])]
        faults = {f: statistics.median(x["faults_median"] for x in runs[stage][f]) for f in ("dsrun", "deepspeed")}
        table[stage] = {"dsrun_ms": statistics.median(mine) * 1e3, "deepspeed_ms": statistics.median(theirs) * 1e3,
                        "ratio": statistics.median(pairs), "pairs": pairs, "cpu_ratio": statistics.median(cpu_pairs),
                        "faults": faults,
                        "first_loss": {f: runs[stage][f][0]["losses"][0] for f in ("dsrun", "deepspeed")}}
        row = table[stage]
        print(f"{stage:<7}{row['dsrun_ms']:>10.1f}{row['deepspeed_ms']:>14.1f}{row['ratio']:>25.2f}x"
              f"{row['cpu_ratio']:>10.2f}x{faults['dsrun']:>9.0f}/{faults['deepspeed']:<8.0f}"
              f"{' '.join(f'{p:.2f}' for p in pairs):>30}")
    print("first-step loss (same model and data in both): "
          + ", ".join(f"stage {s}: {t['first_loss']['dsrun']:.4f} / {t['first_loss']['deepspeed']:.4f}"
                      for s, t in table.items()))
    if args.json:
        args.json.write_text(json.dumps({"table": table, "runs": runs, "options": opts,
                                         "load": [load_before, load_after]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
