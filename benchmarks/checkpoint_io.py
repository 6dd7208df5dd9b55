"""Checkpoint write throughput of each writer as a ratio of the disk's own sequential write bandwidth.

    PYTHONPATH=. python benchmarks/checkpoint_io.py [--dir D] [--model gpt-small | --mb 1200] [--repeats 3]
                                                    [--buffer-mb 64] [--threads 1] [--block-mb 1] [--json out.json]

The checkpoint is a realistic one: ``--model``'s state dict (dsrun's GPT, fp32) plus Adam's two moments per
parameter and a step count, as ``engine.save_checkpoint`` holds them at ZeRO-0 on one rank (gpt-small: 124M
parameters, ~1.49 GB); ``--mb N`` replaces it by N MB of fp32 tensors of 16M elements each.

The disk's bandwidth is measured on the same folder by ``dd if=/dev/zero of=F bs=64M count=N oflag=direct
conv=fsync`` (N: the checkpoint's size in 64 MiB blocks, rounded up; dd's own seconds and bytes), and by a
Python loop of 64 MiB ``os.write`` calls from a page-aligned buffer to an O_DIRECT descriptor then ``fsync``
(the "python O_DIRECT" line); the ratios divide by dd's figure. Each writer then writes the checkpoint with
``torch.save`` to a new file, timed from opening the file to its ``fsync`` returning (every writer's file is
durable, as dsrun's atomic saves make it):

* ``torch.save (plain file)``: dsrun without a ``checkpoint.writer`` section (buffered file + fsync);
* ``python``: DeepSpeed's PyFileWriter (``checkpoint.writer.type: python``), + fsync;
* ``fast``: the FastFileWriter (``type: fast``) as a checkpoint save uses it, ``--buffer-mb`` of I/O buffer,
  double-buffered, filling in every record's CRC32 from its buffer on other threads; ``fast (single buffer)``
  with ``io_buffer_double: false``;
* ``fast (torch's CRC32)``: the same fast writer fed by a plain ``torch.save`` that computes every record's
  CRC32 itself, on the saving thread (~1-1.5 GB/s on one core), before the bytes reach the writer: what the fast
  writer was before it computed them on other threads;
* ``mock``: writes nothing, with torch's CRC32 off (the serialization alone, the ceiling of any writer
  ``torch.save`` feeds; no ratio to the disk); ``mock (torch's CRC32)``: the same with torch's CRC32;
* ``fast (legacy format)``: the fast writer with ``checkpoint.checkpoint_serialization: false``, torch's legacy
  (pre-zipfile) format, which has no CRC32 (a resharded load then reads such files whole: no record offsets).

After each ``fast`` save the file's CRC32s are checked as a whole load checks them (every record read back and
compared with its stored CRC32): the run fails if one is missing or wrong, and the check's speed is printed.

Each line also gives the CPU seconds the writer used per GB written (every thread of the process, or dd's own
process): on a machine whose cores are busy with other work a writer's speed falls with the CPU it needs, so
this is the figure that does not depend on the load.

Rounds are interleaved (dd, then each writer, then again) so a machine shared with other work drifts into
every line alike; the figures are medians over ``--repeats`` rounds, with min-max. GB/s = 1e9 bytes/s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrun.io import WriterSettings, open_writer  # noqa: E402
from dsrun.io.zip_crc import crc32_mismatches, zip_entries  # noqa: E402
from dsrun.ops.aio import AsyncIOHandle  # noqa: E402

BLOCK = 64 * 1024 ** 2


def checkpoint_state(model: str | None, mb: int | None) -> dict:
    """The object a checkpoint save writes: module weights plus Adam's moments (or ``mb`` MB of tensors)."""
    generator = torch.Generator().manual_seed(0)
    if mb is not None:
        numel, chunk = mb * 10 ** 6 // 4, 16 * 2 ** 20
        return {"module": {f"t{i}": torch.randn(min(chunk, numel - i * chunk), generator=generator)
                           for i in range((numel + chunk - 1) // chunk)}}
    from dsrun.models.gpt import GPT
    from dsrun.models.registry import gpt_config, model_spec

    gpt = GPT(gpt_config(model_spec(model)))
    moments = {name: {"step": torch.tensor(10.0), "exp_avg": torch.randn(p.shape, generator=generator) * 1e-3,
                      "exp_avg_sq": torch.rand(p.shape, generator=generator) * 1e-6}
               for name, p in gpt.named_parameters()}  # one pair per parameter (the tied head shares the embedding's)
    return {"module": gpt.state_dict(), "optimizer": {"state": moments}, "global_steps": 10}


def nbytes_of(state: dict) -> int:
    """Bytes of the distinct storages ``state`` holds (a tied weight's once, as torch.save writes it)."""
    storages: dict[int, int] = {}
    stack: list[object] = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, torch.Tensor):
            storages[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
    return sum(storages.values())


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def dd_write(path: Path, nbytes: int) -> tuple[float, int, float]:
    """dd's seconds and bytes for a new file of ``nbytes`` (rounded up to 64 MiB blocks), O_DIRECT + fsync, and
    its CPU seconds."""
    path.unlink(missing_ok=True)
    count = -(-nbytes // BLOCK)
    cpu = _children_cpu()
    done = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", "oflag=direct",
                           "conv=fsync"], capture_output=True, text=True, check=True)
    match = re.search(r"^(\d+) bytes.*copied, ([0-9.,]+) s", done.stderr, re.MULTILINE)
    assert match, done.stderr
    cpu = _children_cpu() - cpu
    path.unlink()
    return float(match.group(2).replace(",", ".")), int(match.group(1)), cpu


def python_direct_write(path: Path, nbytes: int) -> tuple[float, int, float]:
    """64 MiB ``os.write`` calls from a page-aligned buffer to an O_DIRECT descriptor, then fsync."""
    path.unlink(missing_ok=True)
    handle = AsyncIOHandle()
    buffer = handle.new_cpu_locked_tensor(BLOCK, torch.empty(0, dtype=torch.uint8))
    buffer.fill_(1)
    view = memoryview(buffer.numpy())
    count = -(-nbytes // BLOCK)
    start, cpu = time.perf_counter(), time.process_time()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for _ in range(count):
            os.write(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    path.unlink()
    return seconds, count * BLOCK, cpu


def writer_save(settings: WriterSettings | None, torch_crc32: bool | None = None,
                legacy: bool = False, checks: list[float] | None = None
                ) -> Callable[[Path, dict], tuple[float, int, float]]:
    """``torch_crc32`` None: a save as ``dsrun.checkpoint.atomic.save_torch`` makes it (``CheckpointFile.save``:
    through the fast writer torch's CRC32 is off and the writer fills it in); True: plain ``torch.save`` into the
    writer, torch computing every CRC32 on the saving thread (the fast writer before it filled them); False: with
    torch's CRC32 off (the mock's serialization alone). ``checks``: append the seconds of the load-side CRC32
    check of the file written (``dsrun.checkpoint.safe_load.check_records``)."""
    def save(path: Path, state: dict) -> tuple[float, int, float]:
        path.unlink(missing_ok=True)
        kwargs = {"_use_new_zipfile_serialization": not legacy}
        start, cpu = time.perf_counter(), time.process_time()
        torch.serialization.set_crc32_options(torch_crc32 is not False)
        try:
            with open_writer(path, settings) as fh:
                if torch_crc32 is None:
                    fh.save(state, **kwargs)
                else:
                    torch.save(state, fh, **kwargs)
        finally:
            torch.serialization.set_crc32_options(True)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        written = int(fh.writer.statistics()["bytes"])
        if checks is not None:
            start = time.perf_counter()
            bad = crc32_mismatches(path)
            checks.append(time.perf_counter() - start)
            assert not bad and any(entry.crc for entry in _entries(path)), f"{path}: CRC32s not filled: {bad}"
        path.unlink()
        return seconds, written, cpu
    return save


def _entries(path: Path) -> list:
    fd = os.open(path, os.O_RDONLY)
    try:
        return zip_entries(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="the folder to write in (default: a new one in .)")
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--mb", type=int, default=None, help="write N MB of plain tensors instead of a model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buffer-mb", type=int, default=64, help="checkpoint.writer.io_buffer_size in MiB")
    parser.add_argument("--threads", type=int, default=1, help="aio.thread_count of the fast writer's handle")
    parser.add_argument("--block-mb", type=int, default=1, help="aio.block_size in MiB (each request's chunks)")
    parser.add_argument("--only", default=None, help="comma-separated writer names to run (default: all)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    folder = Path(tempfile.mkdtemp(prefix="checkpoint_io_", dir=args.dir or Path.cwd()))
    state = checkpoint_state(None if args.mb else args.model, args.mb)
    size = nbytes_of(state)
    aio = (("block_size", args.block_mb * 1024 ** 2), ("thread_count", args.threads))
    buffer = args.buffer_mb * 1024 ** 2
    fast = WriterSettings(type="FAST", io_buffer_size=buffer, aio=aio)
    checks: list[float] = []
    writers: dict[str, Callable[[Path, dict], tuple[float, int, float]]] = {
        "torch.save (plain file)": writer_save(None),
        "python": writer_save(WriterSettings(type="PYTHON")),
        "fast": writer_save(fast, checks=checks),
        "fast (single buffer)": writer_save(WriterSettings(type="FAST", io_buffer_size=buffer,
                                                           io_buffer_double=False, aio=aio)),
        "fast (torch's CRC32)": writer_save(fast, torch_crc32=True),
        "mock": writer_save(WriterSettings(type="MOCK"), torch_crc32=False),
        "mock (torch's CRC32)": writer_save(WriterSettings(type="MOCK"), torch_crc32=True),
        "fast (legacy format)": writer_save(fast, legacy=True),
    }
    if args.only:
        writers = {name: run for name, run in writers.items() if name in args.only.split(",")}
    print(f"checkpoint: {size / 1e9:.2f} GB of tensors ({'--mb' if args.mb else args.model}); folder {folder}; "
          f"io_buffer_size {args.buffer_mb} MiB, aio.block_size {args.block_mb} MiB, aio.thread_count "
          f"{args.threads}; {args.repeats} rounds; load average {os.getloadavg()[0]:.2f}", flush=True)
    speeds: dict[str, list[float]] = {"dd (O_DIRECT, fsync)": [], "python O_DIRECT loop": [],
                                      **{name: [] for name in writers}}
    cpus: dict[str, list[float]] = {name: [] for name in speeds}  # CPU seconds per GB written (all threads)
    try:
        for round_ in range(args.repeats):
            for name, run in (("dd (O_DIRECT, fsync)", lambda p: dd_write(p, size)),
                              ("python O_DIRECT loop", lambda p: python_direct_write(p, size)),
                              *((n, (lambda w: lambda p: w(p, state))(w)) for n, w in writers.items())):
                seconds, written, cpu = run(folder / "f.bin")
                speeds[name].append(written / seconds / 1e9)
                cpus[name].append(cpu / (written / 1e9))
                print(f"  round {round_ + 1} {name:26s} {written / seconds / 1e9:6.2f} GB/s "
                      f"({written / 1e9:.2f} GB in {seconds:.2f} s, {cpu:.2f} CPU s)", flush=True)
    finally:
        for leftover in folder.iterdir():
            leftover.unlink()
        folder.rmdir()
    print(f"load average at the end {os.getloadavg()[0]:.2f} (above ~1.5 on this 2-core VM: a loaded machine)")
    disk = statistics.median(speeds["dd (O_DIRECT, fsync)"])
    print(f"\n{'writer':28s} {'GB/s (median)':>14s} {'min-max':>13s} {'x disk (dd)':>12s} {'CPU s/GB':>9s}")
    results = {}
    for name, values in speeds.items():
        median = statistics.median(values)
        ratio = None if name.startswith("mock") else median / disk
        cpu = statistics.median(cpus[name])
        results[name] = {"gbps_median": median, "gbps_min": min(values), "gbps_max": max(values), "x_disk": ratio,
                         "cpu_s_per_gb": cpu}
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        print(f"{name:28s} {median:14.2f} {min(values):6.2f}-{max(values):<6.2f} {shown:>12s} {cpu:9.2f}")
    if checks:
        check = statistics.median(checks)
        results["load CRC32 check"] = {"seconds_median": check, "gbps_median": size / check / 1e9}
        print(f"\nthe load-side CRC32 check of the fast writer's file (read back, every record): "
              f"{size / check / 1e9:.2f} GB/s ({check:.2f} s, median)")
    if args.json:
        args.json.write_text(json.dumps({"bytes": size, "buffer_mb": args.buffer_mb, "threads": args.threads, "block_mb": args.block_mb,
                                         "repeats": args.repeats, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
