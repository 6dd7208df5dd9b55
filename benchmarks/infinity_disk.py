"""ZeRO-Infinity against the disk's bandwidth: how close a step comes to the time its NVMe bytes need.

    PYTHONPATH=. python benchmarks/infinity_disk.py                          # gpt-large (0.77B), 3 steps, in /tmp
    PYTHONPATH=. python benchmarks/infinity_disk.py --size gpt-4b --disk-budget-gb 72 --nvme-path /local_nvme
    PYTHONPATH=. python benchmarks/infinity_disk.py --size gpt-medium --steps 4 --json out.json

1. **The disk**, in the folder the run swaps to (``--nvme-path``): sequential write (to a new file) and read of
   ``--disk-gib`` GiB in one request through dsrun's async I/O op with the run's ``aio`` settings (page-aligned
   buffer: O_DIRECT), and the same through ``dd`` (bs=1M, O_DIRECT) and ``fio`` where installed. Medians over
   ``--rounds``; GB = 1e9 bytes.
2. **The run**, in a subprocess: ``benchmarks/scale.py``'s ZeRO-Infinity configuration (bf16, AdamW, one rank,
   optimizer and parameters on NVMe, ``max_in_cpu: 0``, micro-batch 1 x 64 tokens) of ``--size``, built under
   ``zero.Init``, trained ``--steps`` steps. Per step: wall time (forward, backward, step) and the bytes read and
   written through the swap files, from the swap stores' own counters (the engine's
   ``Train/Samples/nvme_read_bytes`` / ``nvme_written_bytes``, :mod:`dsrun.zero.swap_traffic`).
3. **The ratio**: step time / (read bytes / read bandwidth + written bytes / write bandwidth), with the best
   read and in-place overwrite bandwidth any probe of dsrun's op reached (the issue's target: at most 1.3 on the
   4B model). A step's writes after the first rewrite existing files in place, so the overwrite figure is
   the one that applies; a write that allocates a new file's blocks is reported too. Steps after the first are reported (the first
   records the module trace and, with ``fast_init``, reads no optimizer states).

``--replay-optimizer GROUPS`` adds the NVMe optimizer step's requests alone (no model: sub-groups of
``--replay-numel`` elements read and written as AdamW's step does, through the same pipeline), to compare pipeline
depths and ``--aio`` settings on this disk.

Bytes are load-independent; times are not: run it on an idle machine. A size whose files would not fit
``--disk-budget-gb`` (16 bytes per parameter) or the free space is refused. The swap folder and the test file
are deleted at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
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
sys.path.insert(0, str(REPO / "benchmarks"))

BYTES_PER_PARAM_FILES = 16.0  # fp32 master + 2 Adam moments + bf16 gradient + bf16 shard (docs/zero_infinity.md)


# --------------------------------------------------------------------------------------------------------
# 1. the disk
# --------------------------------------------------------------------------------------------------------
# aio settings the disk is probed with: the run's (DeepSpeed's defaults) and a deeper queue
PROBE_AIO = {"aio defaults (bs=1M qd=8 t=1)": {}, "bs=1M qd=32 t=1": {"queue_depth": 32},
             "bs=8M qd=16 t=1": {"block_size": 8 << 20, "queue_depth": 16}}


def aio_bandwidth(folder: Path, nbytes: int, rounds: int, aio: dict[str, Any]) -> dict[str, Any]:
    """GB/s of one ``nbytes`` request through dsrun's op with the ``aio`` section ``aio``: a write to a new file,
    an overwrite of it in place (what a step's swap writes are after the first) and a read."""
    import torch

    from dsrun.ops.aio import AsyncIOHandle

    handle = AsyncIOHandle.from_config(aio)
    buffer = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    path = folder / f"dsrun_disk_probe_{os.getpid()}.bin"
    figures: dict[str, list[float]] = {"write_new": [], "overwrite": [], "read": []}

    def timed(name: str, start: Any) -> None:
        t = time.perf_counter()
        start(buffer, path)
        handle.wait()
        figures[name].append(nbytes / (time.perf_counter() - t) / 1e9)

    try:
        for _ in range(rounds):
            path.unlink(missing_ok=True)
            timed("write_new", handle.async_pwrite)
            timed("overwrite", handle.async_pwrite)
            timed("read", handle.async_pread)
    finally:
        path.unlink(missing_ok=True)
    out: dict[str, Any] = {f"{k}_gbps": statistics.median(v) for k, v in figures.items()}
    out.update(rounds=figures, engine=handle.get_engine(), direct_bytes=handle.get_direct_bytes())
    return out


def dd_bandwidth(folder: Path, nbytes: int, rounds: int) -> dict[str, Any] | None:
    if shutil.which("dd") is None:
        return None
    path, count = folder / f"dsrun_dd_probe_{os.getpid()}.bin", nbytes // (1 << 20)
    writes, reads = [], []
    try:
        for _ in range(rounds):
            path.unlink(missing_ok=True)
            for args, out in ((["if=/dev/zero", f"of={path}", "oflag=direct"], writes),
                              ([f"if={path}", "of=/dev/null", "iflag=direct"], reads)):
                t = time.perf_counter()
                subprocess.run(["dd", *args, "bs=1M", f"count={count}", "status=none"], check=True)
                out.append(count * (1 << 20) / (time.perf_counter() - t) / 1e9)
    finally:
        path.unlink(missing_ok=True)
    return {"write_gbps": statistics.median(writes), "read_gbps": statistics.median(reads)}


def fio_bandwidth(folder: Path, nbytes: int) -> dict[str, Any] | None:
    if shutil.which("fio") is None:
        return None
    path = folder / f"dsrun_fio_probe_{os.getpid()}.bin"
    result = {}
    try:
        for mode in ("write", "read"):
            out = subprocess.run(["fio", "--name=probe", f"--filename={path}", f"--rw={mode}", "--bs=1M",
                                  f"--size={nbytes}", "--direct=1", "--ioengine=libaio", "--iodepth=8",
                                  "--output-format=json"], check=True, capture_output=True, text=True).stdout
            job = json.loads(out)["jobs"][0][mode]
            result[f"{mode}_gbps"] = job["bw_bytes"] / 1e9
    finally:
        path.unlink(missing_ok=True)
    return result


def probe_disk(folder: Path, nbytes: int, rounds: int) -> dict[str, Any]:
    """Every probe of the disk in ``folder`` (dsrun's op with each :data:`PROBE_AIO` setting, ``dd``, ``fio``),
    printed."""
    disk = {"folder": str(folder), "probe_bytes": nbytes,
            "aio": {label: aio_bandwidth(folder, nbytes, rounds, aio) for label, aio in PROBE_AIO.items()},
            "dd": dd_bandwidth(folder, nbytes, rounds), "fio": fio_bandwidth(folder, nbytes)}
    for label, fig in disk["aio"].items():
        print(f"[infinity_disk] disk, dsrun's op, {label}: write (new file) {fig['write_new_gbps']:.2f} GB/s, "
              f"overwrite {fig['overwrite_gbps']:.2f} GB/s, read {fig['read_gbps']:.2f} GB/s", flush=True)
    for name in ("dd", "fio"):
        if disk.get(name):
            print(f"[infinity_disk] disk, {name} (O_DIRECT, bs=1M): write {disk[name]['write_gbps']:.2f} GB/s, "
                  f"read {disk[name]['read_gbps']:.2f} GB/s", flush=True)
    return disk


def best_bandwidth(disk: dict[str, Any]) -> None:
    """The disk's bandwidth: the best any probe of dsrun's op reached (a step rewrites its files in place after
    the first, so the overwrite figure is the write's)."""
    disk["read_gbps"] = max(f["read_gbps"] for f in disk["aio"].values())
    disk["write_gbps"] = max(f["overwrite_gbps"] for f in disk["aio"].values())


def replay_optimizer_io(folder: Path, groups: int, numel: int, depth: int, rounds: int, compute_s: float,
                        aio: dict[str, Any]) -> dict[str, Any]:
    """The NVMe optimizer step's requests without a model: ``groups`` sub-groups of ``numel`` elements, each
    read as AdamW's step reads it (fp32 master, bf16 gradient, two fp32 moments, one read lane each) and
    written back (master and moments), through ``SwapStore`` and ``run_swap_pipeline`` at ``depth`` slots
    (4 buffers each), the update replaced by ``compute_s`` of sleep. GB/s of read + written bytes per round:
    what the pipeline's shape and the ``aio`` settings get out of this disk."""
    import torch

    from dsrun.offload.pipeline import run_swap_pipeline
    from dsrun.offload.swap_store import SwapStore

    store = SwapStore(folder, aio_config=aio or None, read_lanes=4)
    try:
        slots = [[store.aligned_buffer(numel) for _ in range(4)] for _ in range(depth)]
        for buffer in slots[0]:
            buffer.fill_(1.0)
        for g in range(groups):
            for name in ("master", "exp_avg", "exp_avg_sq"):
                store.async_write(f"{name}.{g}", slots[0][0])
            store.async_write(f"grad.{g}", slots[0][1].view(torch.bfloat16)[:numel])
            store.wait_writes()

        def issue_read(g: int) -> None:
            master, grad, avg, avg_sq = slots[g % depth]
            store.async_read(f"master.{g}", master, lane=0)
            store.async_read(f"grad.{g}", grad.view(torch.bfloat16)[:numel], lane=1)
            store.async_read(f"exp_avg.{g}", avg, lane=2)
            store.async_read(f"exp_avg_sq.{g}", avg_sq, lane=3)

        def issue_write(g: int) -> None:
            master, _, avg, avg_sq = slots[g % depth]
            for name, buffer in (("master", master), ("exp_avg", avg), ("exp_avg_sq", avg_sq)):
                store.async_write(f"{name}.{g}", buffer)

        moved = groups * numel * (4 + 2 + 8 + 12)
        figures = []
        for _ in range(rounds):
            t = time.perf_counter()
            times = run_swap_pipeline(groups, depth, issue_read, store.wait_reads, lambda g: time.sleep(compute_s),
                                      issue_write, store.wait_writes)
            seconds = time.perf_counter() - t
            figures.append({"seconds": seconds, "gbps": moved / seconds / 1e9, **times.extra})
            print(f"[infinity_disk] optimizer I/O replay, {groups} x {numel} elements, depth {depth}, aio {aio}: "
                  f"{moved / 1e9:.1f} GB in {seconds:.2f} s = {moved / seconds / 1e9:.2f} GB/s (waiting on reads "
                  f"{times.extra['waiting_reads']:.2f} s, on writes {times.extra['waiting_writes']:.2f} s)", flush=True)
    finally:
        store.close()
    return {"groups": groups, "numel": numel, "depth": depth, "compute_s": compute_s, "aio": aio,
            "bytes_per_round": moved, "rounds": figures}


# --------------------------------------------------------------------------------------------------------
# 2. the run (in its own process)
# --------------------------------------------------------------------------------------------------------
def disk_counters(folder: str) -> tuple[float, int, int] | None:
    """(seconds the disk under ``folder`` has been busy, bytes read, bytes written) from the kernel's block
    statistics: every process's I/O, not only this run's; None where they cannot be read."""
    dev = os.stat(folder).st_dev
    try:
        fields = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    except OSError:
        return None
    return int(fields[9]) / 1e3, int(fields[2]) * 512, int(fields[6]) * 512


def run_child(size: str, steps: int, nvme_root: str, threads: int, aio: dict[str, Any],
              super_offload: bool = False, gradient_clipping: float | None = None) -> dict[str, Any]:
    import torch

    import dsrun
    from scale import SEQ, ds_config, model_kwargs

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kwargs = model_kwargs(size)
    tokens = torch.randint(0, kwargs["vocab_size"], (1, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    from dsrun.models.gpt import GPT

    config = ds_config("infinity", kwargs, nvme_root)
    if aio:
        config["aio"] = aio
    if gradient_clipping is not None:
        config["gradient_clipping"] = gradient_clipping
    config["zero_optimization"]["offload_optimizer"]["super_offload"] = super_offload
    t0 = time.perf_counter()
    dsrun.init_distributed(verbose=False)
    with dsrun.zero.Init(config_dict_or_path=config):
        model = GPT(**kwargs)
    engine, _, _, _ = dsrun.initialize(model=model, config=config)
    build_s = time.perf_counter() - t0
    numel = sum(p.ds_numel for p in engine.module.parameters())
    records = []
    params_read = engine.strategy.param_offload.stats()["read_bytes"]
    try:
        backward_steps = engine.strategy.placement.offloaded.swapped.backward_steps
        for step in range(steps):
            marks = [disk_counters(nvme_root)]  # the disk before forward, backward, the step, and after
            t = time.perf_counter()
            loss = engine(inputs, targets)
            t_fwd = time.perf_counter()
            marks.append(disk_counters(nvme_root))
            engine.backward(loss)
            t_bwd = time.perf_counter()
            marks.append(disk_counters(nvme_root))
            engine.step()
            t_end = time.perf_counter()
            marks.append(disk_counters(nvme_root))
            disk = [b - a for a, b in zip(marks[0], marks[-1])] if all(marks) else None
            # per phase: (disk busy s, bytes read, bytes written) of forward, backward, step
            phases = {name: [b - a for a, b in zip(marks[k], marks[k + 1])] for k, name in
                      enumerate(("forward", "backward", "step"))} if all(marks) else None
            in_backward = dict(backward_steps.times, read_ahead_hits=backward_steps.read_ahead_hits) \
                if backward_steps is not None else None
            io = engine.observer.last_swap_io
            pipe = engine.strategy.last_step_times
            offload = engine.strategy.param_offload.stats()
            params_read, param_read_bytes = offload["read_bytes"], offload["read_bytes"] - params_read
            records.append({"step": step + 1, "loss": float(loss.detach()), "seconds": t_end - t, "forward_s": t_fwd - t,
                            "backward_s": t_bwd - t_fwd, "step_s": t_end - t_bwd,
                            "read_bytes": io.read_bytes, "written_bytes": io.written_bytes,
                            "reads": io.reads, "writes": io.writes,
                            "optimizer_compute_s": pipe.compute if pipe else None,
                            "optimizer_waiting_s": pipe.waiting if pipe else None,
                            "optimizer_waiting_reads_s": pipe.extra.get("waiting_reads") if pipe else None,
                            "optimizer_waiting_writes_s": pipe.extra.get("waiting_writes") if pipe else None,
                            "param_offload": offload, "param_read_bytes": param_read_bytes,
                            "disk_busy_s": disk[0] if disk else None,
                            "disk_read_bytes": disk[1] if disk else None,
                            "disk_written_bytes": disk[2] if disk else None, "disk_phases": phases,
                            "super_offload_in_backward": in_backward})
            print(f"[infinity_disk] {size} step {step + 1}: loss {float(loss.detach()):.4f}, {t_end - t:.1f} s "
                  f"(fwd {t_fwd - t:.1f}, bwd {t_bwd - t_fwd:.1f}, step {t_end - t_bwd:.1f}), read "
                  f"{io.read_bytes / 1e9:.2f} GB (parameters {param_read_bytes / 1e9:.2f}), written "
                  f"{io.written_bytes / 1e9:.2f} GB" + (f"; disk busy {disk[0]:.1f} s" if disk else "")
                  + (f"; optimizer: compute {pipe.compute:.1f} s, waiting on reads {pipe.extra['waiting_reads']:.1f} "
                     f"s, on writes {pipe.extra['waiting_writes']:.1f} s" if pipe and pipe.extra else "")
                  + (f"; in backward: compute {in_backward['compute']:.1f} s, waiting on reads "
                     f"{in_backward['waiting_reads']:.1f} s, on writes {in_backward['waiting_writes']:.1f} s"
                     if in_backward else "")
                  + ("; disk per phase (busy s, GB read, GB written): " + ", ".join(
                      f"{k} {v[0]:.1f}/{v[1] / 1e9:.2f}/{v[2] / 1e9:.2f}" for k, v in phases.items())
                     if phases else ""), flush=True)
    finally:
        engine.destroy()
    return {"size": size, "params": numel, "build_s": build_s, "aio": aio, "super_offload": super_offload,
            "gradient_clipping": config.get("gradient_clipping"), "steps": records}


# --------------------------------------------------------------------------------------------------------
# 3. the ratio
# --------------------------------------------------------------------------------------------------------
def summarise(disk: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    later = run["steps"][1:] or run["steps"]
    read_bw, write_bw = disk["read_gbps"] * 1e9, disk["write_gbps"] * 1e9
    per_step = []
    for rec in later:
        bound = rec["read_bytes"] / read_bw + rec["written_bytes"] / write_bw
        per_step.append({"step": rec["step"], "seconds": rec["seconds"], "disk_bound_s": bound,
                         "ratio": rec["seconds"] / bound, "disk_busy_share": (rec["disk_busy_s"] / rec["seconds"])
                         if rec.get("disk_busy_s") is not None else None})
    params = run["params"]
    median_ratio = statistics.median(r["ratio"] for r in per_step)
    return {"read_bytes_per_param": later[-1]["read_bytes"] / params,
            "written_bytes_per_param": later[-1]["written_bytes"] / params,
            "step_s": statistics.median(r["seconds"] for r in per_step),
            "disk_bound_s": statistics.median(r["disk_bound_s"] for r in per_step),
            "ratio": median_ratio, "per_step": per_step,
            "disk_busy_share": statistics.median(r["disk_busy_share"] for r in per_step)
            if all(r["disk_busy_share"] is not None for r in per_step) else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="gpt-large", help="a model size of benchmarks/scale.py (gpt-4b ...)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--disk-gib", type=float, default=1.0, help="bytes per disk probe request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--disk-budget-gb", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--aio", default="{}", help="the run's aio section as JSON, e.g. '{\"queue_depth\": 32}' "
                        "(default: DeepSpeed's defaults)")
    parser.add_argument("--skip-run", action="store_true", help="measure the disk only")
    parser.add_argument("--super-offload", action="store_true", help="offload_optimizer.super_offload: each "
                        "sub-group stepped during backward (needs --gradient-clipping 0, which it sets)")
    parser.add_argument("--gradient-clipping", type=float, default=None,
                        help="the run's gradient_clipping (default: the config's, 1.0; 0 for a baseline of "
                        "--super-offload)")
    parser.add_argument("--disk-json", default=None, help="no disk probe: use the disk figures of this earlier result "
                        "JSON of the script (alternating runs share one probe)")
    parser.add_argument("--replay-optimizer", type=int, default=0, metavar="GROUPS",
                        help="also replay the NVMe optimizer step's I/O alone over GROUPS sub-groups (files: 14 bytes "
                        "per element; see --replay-numel, --replay-depth, --replay-compute-s; rounds: --rounds)")
    parser.add_argument("--replay-numel", type=int, default=50_000_000, help="elements per replayed sub-group")
    parser.add_argument("--replay-depth", type=int, default=2, help="pipeline slots (4 buffers each)")
    parser.add_argument("--replay-compute-s", type=float, default=0.1, help="seconds standing for each update")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    folder = Path(args.nvme_path)
    if args.child:
        Path(args.out).write_text(json.dumps(run_child(args.size, args.steps, str(folder), args.threads,
                                                       json.loads(args.aio), args.super_offload,
                                                       args.gradient_clipping)))
        return 0

    folder.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.disk_gib * (1 << 30)) // (1 << 20) * (1 << 20)
    if args.super_offload and args.gradient_clipping is None:
        args.gradient_clipping = 0.0
    disk = json.loads(Path(args.disk_json).read_text())["disk"] if args.disk_json else probe_disk(folder, nbytes,
                                                                                                  args.rounds)
    best_bandwidth(disk)
    result: dict[str, Any] = {"disk": disk, "load_before": os.getloadavg()}
    if args.replay_optimizer:
        replay_root = Path(tempfile.mkdtemp(prefix="dsrun_infinity_replay_", dir=folder))
        try:
            result["optimizer_replay"] = replay_optimizer_io(replay_root, args.replay_optimizer, args.replay_numel,
                                                             args.replay_depth, args.rounds, args.replay_compute_s,
                                                             json.loads(args.aio))
        finally:
            shutil.rmtree(replay_root, ignore_errors=True)
    if not args.skip_run:
        from scale import num_params

        need_gb = num_params(args.size) * BYTES_PER_PARAM_FILES / 1e9
        free_gb = shutil.disk_usage(folder).free / 1e9
        if need_gb > min(args.disk_budget_gb, free_gb - 2):
            print(f"[infinity_disk] {args.size}: its files need ~{need_gb:.0f} GB; the budget is "
                  f"{args.disk_budget_gb:g} GB and {free_gb:.0f} GB are free: not run", flush=True)
            return 2
        swap_root = Path(tempfile.mkdtemp(prefix="dsrun_infinity_disk_", dir=folder))
        out = swap_root / "result.json"
        try:
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
            subprocess.run([sys.executable, __file__, "--child", "--size", args.size, "--steps", str(args.steps),
                            "--nvme-path", str(swap_root), "--threads", str(args.threads), "--out", str(out),
                            "--aio", args.aio] + (["--super-offload"] if args.super_offload else [])
                           + (["--gradient-clipping", str(args.gradient_clipping)]
                              if args.gradient_clipping is not None else []),
                           check=True, env=env)
            run = json.loads(out.read_text())
        finally:
            shutil.rmtree(swap_root, ignore_errors=True)
        run["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / (1 << 20)
        result["load_after"] = os.getloadavg()
        if not args.disk_json:
            # this disk's bandwidth drifts by a fifth or more within minutes (a shared host): probe it again after
            # the run and divide by the best of both probes (the smaller bound, the larger ratio)
            before, disk["after"] = dict(disk), probe_disk(folder, nbytes, args.rounds)
            best_bandwidth(disk["after"])
            for label, probe in (("before", before), ("after", disk["after"])):
                print(f"[infinity_disk] ratio with the probe {label} the run alone: "
                      f"{summarise(probe, run)['ratio']:.2f}", flush=True)
            disk["read_gbps"] = max(before["read_gbps"], disk["after"]["read_gbps"])
            disk["write_gbps"] = max(before["write_gbps"], disk["after"]["write_gbps"])
        result.update(run=run, summary=summarise(disk, run))
        s = result["summary"]
        print(f"[infinity_disk] {args.size} ({run['params'] / 1e9:.2f}B): {s['read_bytes_per_param']:.1f} B/param "
              f"read + {s['written_bytes_per_param']:.1f} B/param written per step; step {s['step_s']:.1f} s, "
              f"disk bound {s['disk_bound_s']:.1f} s: ratio {s['ratio']:.2f}; disk busy "
              f"{100 * (s['disk_busy_share'] or 0):.0f}% of the step (peak RSS {run['peak_rss_gib']:.1f} "
              f"GiB; load {result['load_before'][0]:.1f} -> {result['load_after'][0]:.1f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
