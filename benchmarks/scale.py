"""How large a GPT this machine can train, per mode: plain PyTorch AdamW, ZeRO-3, ZeRO-3 + CPU offload, and
ZeRO-Infinity (optimizer states and parameters in NVMe files).

For each mode the script climbs a size ladder (the named sizes in ``conf/model/`` plus a few in between)
and trains each size for 3 steps on one fixed batch, in a subprocess of its own. An attempt succeeds when
every loss is finite and each step's loss is lower than the one before. It fails on an out-of-memory kill,
when the process's resident memory passes ``--mem-limit-gb`` or the machine's available memory falls below
``--min-available-gb`` (the watchdog kills it first, so a failed attempt never takes the machine down with
it), on an error, or past ``--timeout``. The parent samples the child's RSS (psutil) and the size of its swap
folder, so the table reports measured peaks. A size whose NVMe files would not fit ``--disk-budget-gb``
(bytes per parameter measured on the largest successful NVMe attempt, else 16 B) is reported, not run.

    python benchmarks/scale.py                       # every mode, the full ladder (slow: tens of minutes)
    python benchmarks/scale.py --modes infinity --sizes gpt-2.7b gpt-3.2b
    python benchmarks/scale.py --ratio gpt-medium    # NVMe / in-memory ZeRO-3 step time, medians of repeats
    python benchmarks/scale.py --quick               # smoke run: tiny sizes, all modes, the ratio

One rank with all cores (``OMP_NUM_THREADS``) per attempt: on one machine, ZeRO's partitioning across ranks
does not lower the machine's total memory, offloading does. dsrun modes compute in bf16 (fp32 master weights
and Adam states); plain PyTorch trains in fp32 (AdamW, 16 bytes per parameter). Results are appended to
``--json`` (default ``benchmarks/scale_results.json``) as they come, so a long climb can be resumed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("torch", "zero3", "zero3_cpu", "infinity")
MODE_TITLES = {"torch": "PyTorch AdamW (fp32)", "zero3": "ZeRO-3 (bf16)", "zero3_cpu": "ZeRO-3 + CPU offload",
               "infinity": "ZeRO-Infinity (NVMe)"}
VOCAB, SEQ, LR = 50257, 64, 1e-5  # 1e-4 overshoots on one fixed batch at 0.8B+ (loss back up by step 3)
# sizes between the named ones (same shape family as gpt-6.7b: width 4096, 32 heads)
LADDER_EXTRA = {"gpt-3.2b": dict(n_layer=15, n_head=32, n_embd=4096),
                "gpt-4b": dict(n_layer=19, n_head=32, n_embd=4096)}
FULL_LADDER = ["gpt-medium", "gpt-large", "gpt-1.3b", "gpt-xl", "gpt-2.7b", "gpt-3.2b", "gpt-4b", "gpt-6.7b"]
QUICK_LADDER = ["gpt-nano", "gpt-micro", "gpt-mini"]
DEFAULT_NVME_BYTES_PER_PARAM = 16.0  # fp32 master + 2 Adam states + bf16 gradient + bf16 parameter


def model_kwargs(size: str) -> dict[str, Any]:
    from dsrun.models.registry import model_spec

    if size in LADDER_EXTRA:
        spec = dict(model_spec("gpt-6.7b"))
        spec.update(LADDER_EXTRA[size])
    else:
        spec = dict(model_spec(size))
    spec.pop("_target_", None)
    return spec


def num_params(size: str) -> int:
    from dsrun.models.config import GPTConfig

    return GPTConfig.from_kwargs(model_kwargs(size)).num_parameters()


# --------------------------------------------------------------------------------------------------------
# one attempt (runs in its own process)
# --------------------------------------------------------------------------------------------------------
def ds_config(mode: str, kwargs: dict[str, Any], nvme_root: str) -> dict[str, Any]:
    from dsrun.models.config import GPTConfig

    cfg = GPTConfig.from_kwargs(kwargs)
    largest_shard = max(cfg.vocab_size * cfg.n_embd, 4 * cfg.n_embd * cfg.n_embd)
    # tiny (--quick) models: a low persistence threshold, so their matrices are partitioned and offloaded too
    persist = 100_000 if cfg.num_parameters() > 50_000_000 else 1_000
    zero: dict[str, Any] = {"stage": 3, "sub_group_size": 50_000_000, "reduce_bucket_size": 50_000_000,
                            "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_reuse_distance": 0,
                            "stage3_param_persistence_threshold": persist}
    if mode == "zero3_cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    elif mode == "infinity":
        # 8 buffers (pipeline depth 2) of the largest sub-group: the token embedding is one sub-group of its
        # own (50257 x 4096 = 206M elements: 8 x 824 MB at 4B-class widths); 12 would not leave room
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 8,
                                     "fast_init": True}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 4,
                                 "buffer_size": largest_shard, "max_in_cpu": 0}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": zero, "steps_per_print": 10**9}


def run_attempt(mode: str, size: str, steps: int, nvme_root: str) -> dict[str, Any]:
    """Build the model, train ``steps`` steps on one fixed batch; losses and per-step times."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    torch.manual_seed(0)
    kwargs = model_kwargs(size)
    tokens = torch.randint(0, kwargs["vocab_size"], (1, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    t0 = time.perf_counter()
    from dsrun.models.gpt import GPT

    if mode == "torch":
        model = GPT(**kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)

        def train_step() -> float:
            loss = model(inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return float(loss)
    else:
        import dsrun

        config = ds_config(mode, kwargs, nvme_root)
        dsrun.init_distributed(verbose=False)  # a world of one on a free local port
        with dsrun.zero.Init(config_dict_or_path=config):  # partitioned (and offloaded) as it is built
            model = GPT(**kwargs)
        engine, _, _, _ = dsrun.initialize(model=model, config=config)

        def train_step() -> float:
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            return float(loss)
    build_s = time.perf_counter() - t0
    losses, times = [], []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(train_step())
        times.append(time.perf_counter() - t)
        print(f"[scale] {mode} {size} step {len(losses)}: loss {losses[-1]:.4f} in {times[-1]:.1f}s", flush=True)
    return {"losses": losses, "step_times": times, "build_s": build_s}


# --------------------------------------------------------------------------------------------------------
# the parent: subprocesses, watchdog, ladder
# --------------------------------------------------------------------------------------------------------
def folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def attempt(mode: str, size: str, args: argparse.Namespace, steps: int = 3) -> dict[str, Any]:
    """Run one attempt in a subprocess under the memory watchdog; the measured outcome."""
    import psutil

    nvme_root = Path(tempfile.mkdtemp(prefix="dsrun_scale_", dir=args.nvme_path))
    out = nvme_root / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, __file__, "--attempt", mode, size, "--steps", str(steps), "--nvme-path",
           str(nvme_root), "--out", str(out)]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_rss = peak_disk = 0
    killed = None
    tail: list[str] = []
    import threading

    def reader() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            tail.append(line.rstrip())
            del tail[:-30]
            if args.verbose or line.startswith("[scale]"):
                print("    " + line.rstrip(), flush=True)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    ps = psutil.Process(proc.pid)
    last_disk = 0.0
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
        except psutil.Error:
            rss = 0
        peak_rss = max(peak_rss, rss)
        if time.monotonic() - last_disk > 2.0:
            peak_disk = max(peak_disk, folder_bytes(nvme_root))
            last_disk = time.monotonic()
        available = psutil.virtual_memory().available
        if rss > args.mem_limit_gb * 2**30:
            killed = f"RSS passed {args.mem_limit_gb} GiB"
        elif available < args.min_available_gb * 2**30:
            killed = f"machine's available memory fell below {args.min_available_gb} GiB"
        elif time.perf_counter() - start > args.timeout:
            killed = f"timeout ({args.timeout}s)"
        if killed:
            proc.kill()
            break
        time.sleep(0.2)
    proc.wait()
    thread.join(timeout=5)
    wall = time.perf_counter() - start
    result: dict[str, Any] = {"mode": mode, "size": size, "params": num_params(size), "rc": proc.returncode,
                              "peak_rss": peak_rss, "peak_nvme": peak_disk, "wall_s": wall, "load_start": load,
                              "load_end": os.getloadavg()[0]}
    if killed and killed.startswith("timeout"):
        result["status"], result["reason"] = "timeout", killed
    elif killed or proc.returncode in (-9, 137):
        result["status"], result["reason"] = "oom", killed or "killed by the kernel (SIGKILL)"
    elif proc.returncode != 0 or not out.is_file():
        reason = next((line for line in reversed(tail) if "Error" in line or "error" in line), tail[-1] if tail else "")
        memory = "MemoryError" in reason or "out of memory" in reason.lower() or "allocate" in reason
        result["status"], result["reason"] = ("oom" if memory else "error"), reason
    else:
        result.update(json.loads(out.read_text()))
        finite = all(map(math.isfinite, result["losses"]))
        falling = all(b < a for a, b in zip(result["losses"], result["losses"][1:]))
        result["status"] = "nonfinite" if not finite else "ok" if falling else "diverged"
        result["step_s"] = statistics.median(result["step_times"][1:] or result["step_times"])
    shutil.rmtree(nvme_root, ignore_errors=True)  # the swap files go as soon as the attempt ends
    return result


def record(args: argparse.Namespace, result: dict[str, Any]) -> None:
    path = Path(args.json)
    data = json.loads(path.read_text()) if path.is_file() else []
    data.append(result)
    path.write_text(json.dumps(data, indent=1) + "\n")


def nvme_bytes_per_param(results: list[dict[str, Any]]) -> float:
    done = [r for r in results if r["mode"] == "infinity" and r["status"] == "ok" and r["peak_nvme"]]
    if not done:
        return DEFAULT_NVME_BYTES_PER_PARAM
    best = max(done, key=lambda r: r["params"])
    return best["peak_nvme"] / best["params"]


def climb(mode: str, sizes: list[str], args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Try the sizes in increasing order; stop at the first failure."""
    for size in sorted(sizes, key=num_params):
        if mode == "infinity":
            need = nvme_bytes_per_param(results) * num_params(size)
            free = shutil.disk_usage(args.nvme_path).free
            budget = min(args.disk_budget_gb * 1e9, free - 5e9)
            if need > budget:
                result = {"mode": mode, "size": size, "params": num_params(size), "status": "skipped",
                          "reason": f"needs ~{need / 1e9:.0f} GB of NVMe files ({need / num_params(size):.1f} B per "
                                    f"parameter), budget {budget / 1e9:.0f} GB"}
                print(f"  {mode:9s} {size:10s} skipped: {result['reason']}", flush=True)
                results.append(result)
                record(args, result)
                break
        print(f"  {mode:9s} {size:10s} ({fmt_params(num_params(size))}) ...", flush=True)
        result = attempt(mode, size, args)
        results.append(result)
        record(args, result)
        print(f"  {mode:9s} {size:10s} {summary(result)}", flush=True)
        if result["status"] != "ok":
            break


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def summary(r: dict[str, Any]) -> str:
    text = f"{r['status']:8s}"
    if "peak_rss" in r:
        text += f" peak RSS {r['peak_rss'] / 2**30:5.1f} GiB"
    if r.get("peak_nvme"):
        text += f", NVMe {r['peak_nvme'] / 1e9:5.1f} GB"
    if "step_s" in r:
        text += f", {r['step_s']:.1f} s/step, losses " + " ".join(f"{x:.3f}" for x in r["losses"])
    if r.get("reason"):
        text += f" ({r['reason']})"
    return text


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| mode | largest that trains | params | peak RSS | NVMe files | s/step | losses | first failure |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        ok = [r for r in rows if r["status"] == "ok"]
        best = max(ok, key=lambda r: r["params"]) if ok else None
        bad = [r for r in rows if r["status"] != "ok" and (best is None or r["params"] > best["params"])]
        fail = min(bad, key=lambda r: r["params"]) if bad else None
        fail_text = f"{fail['size']}: {fail['status']} ({fail.get('reason', '')})" if fail else "-"
        if best is None:
            lines.append(f"| {MODE_TITLES[mode]} | none | | | | | | {fail_text} |")
            continue
        lines.append(f"| {MODE_TITLES[mode]} | {best['size']} | {fmt_params(best['params'])} | "
                     f"{best['peak_rss'] / 2**30:.1f} GiB | {best['peak_nvme'] / 1e9:.1f} GB | {best['step_s']:.1f} | "
                     f"{' → '.join(f'{x:.3f}' for x in best['losses'])} | {fail_text} |")
    return "\n".join(lines)


def ratio(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """Median step time of ZeRO-Infinity over in-memory ZeRO-3, alternating repeats of each."""
    times: dict[str, list[float]] = {"zero3": [], "infinity": []}
    for rep in range(args.repeats):
        for mode in ("zero3", "infinity"):
            r = attempt(mode, size, args, steps=args.ratio_steps)
            if r["status"] not in ("ok", "diverged"):  # timing needs finite steps, not a falling loss
                raise SystemExit(f"ratio: {mode} {size} failed: {summary(r)}")
            times[mode].append(r["step_s"])
            print(f"  ratio {size} repeat {rep + 1}: {mode} {r['step_s']:.2f} s/step (load {r['load_start']:.1f})",
                  flush=True)
    medians = {m: statistics.median(v) for m, v in times.items()}
    out = {"size": size, "params": num_params(size), "times": times, "medians": medians,
           "ratio": medians["infinity"] / medians["zero3"], "load": os.getloadavg()[0]}
    print(f"  ratio NVMe / in-memory ZeRO-3 on {size}: {out['ratio']:.2f} "
          f"({medians['infinity']:.2f} s vs {medians['zero3']:.2f} s per step, medians of {args.repeats})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--sizes", nargs="+", default=None, help="sizes to climb (default: the full ladder)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes and a quick ratio")
    parser.add_argument("--ratio", default=None, metavar="SIZE", help="measure the NVMe / in-memory step time ratio")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio-steps", type=int, default=4)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--mem-limit-gb", type=float, default=21.0)
    parser.add_argument("--min-available-gb", type=float, default=0.75)
    parser.add_argument("--disk-budget-gb", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=1500.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "scale_results.json"))
    parser.add_argument("--verbose", action="store_true")
    # internal: one attempt in this process
    parser.add_argument("--attempt", nargs=2, metavar=("MODE", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.attempt:
        mode, size = args.attempt
        result = run_attempt(mode, size, args.steps, args.nvme_path)
        Path(args.out).write_text(json.dumps(result))
        return 0

    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    print(f"# scale benchmark on {os.cpu_count()} cores, "
          f"{__import__('psutil').virtual_memory().total / 2**30:.1f} GiB RAM, load {os.getloadavg()[0]:.1f}",
          flush=True)
    results: list[dict[str, Any]] = []
    if args.ratio or args.quick:
        out = ratio(args.ratio or "gpt-micro", args)
        record(args, {"mode": "ratio", **out})
        if not args.quick:
            return 0
    sizes = args.sizes or (QUICK_LADDER if args.quick else FULL_LADDER)
    for mode in args.modes:
        climb(mode, sizes, args, results)
    print(table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
