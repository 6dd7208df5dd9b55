"""Benchmark dsrun's async I/O handle against ``dd`` with O_DIRECT, writing and reading 1 GiB.

    PYTHONPATH=. python benchmarks/aio.py [--dir /tmp] [--gib 1] [--rounds 3]

Each round runs, on the same file system, for ``dd`` (bs=1M, O_DIRECT) and then our handle with each setting in
ENGINES (page-aligned buffers, so the bulk goes through O_DIRECT): a write to a new file, an overwrite of the
existing file in place (dd ``conv=notrunc``), and a read. Figures are
medians over rounds with the min-max spread; GB/s = 1e9 bytes per second.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrun.ops.aio import AsyncIOHandle  # noqa: E402

# label -> AsyncIOHandle keyword arguments
ENGINES: dict[str, dict] = {
    "libaio bs=1M qd=8 t=1 (aio defaults)": dict(engine="libaio"),
    "libaio bs=1M qd=32 t=2": dict(engine="libaio", queue_depth=32, intra_op_parallelism=2),
    "libaio bs=1M qd=8 t=1 single_submit": dict(engine="libaio", single_submit=True),
    "threads bs=1M t=1": dict(engine="threads"),
    "threads bs=1M t=4": dict(engine="threads", intra_op_parallelism=4),
}


def dd(path: Path, nbytes: int, mode: str) -> float:
    """mode: "new" (write a fresh file), "overwrite" (rewrite an existing one in place) or "read"."""
    count = nbytes // (1 << 20)
    if mode == "new":
        path.unlink(missing_ok=True)
    args = {"new": ["dd", "if=/dev/zero", f"of={path}", "oflag=direct"],
            "overwrite": ["dd", "if=/dev/zero", f"of={path}", "oflag=direct", "conv=notrunc"],
            "read": ["dd", f"if={path}", "of=/dev/null", "iflag=direct"]}[mode]
    t0 = time.perf_counter()
    subprocess.run([*args, "bs=1M", f"count={count}", "status=none"], check=True)
    return nbytes / (time.perf_counter() - t0) / 1e9


def ours(handle: AsyncIOHandle, buffer: torch.Tensor, path: Path, mode: str) -> float:
    if mode == "new":
        path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    if mode != "read":
        handle.async_pwrite(buffer, path)
    else:
        handle.async_pread(buffer, path)
    handle.wait()
    return buffer.numel() / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"), help="where the 1 GiB file goes")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    nbytes = int(args.gib * (1 << 30)) // (1 << 20) * (1 << 20)
    path = Path(args.dir) / f"dsrun_aio_bench_{os.getpid()}.bin"

    handles = {label: AsyncIOHandle(**kw) for label, kw in ENGINES.items()}
    buffer = next(iter(handles.values())).new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    modes = ("new", "overwrite", "read")
    results: dict[str, list[tuple[float, ...]]] = {"dd (O_DIRECT, bs=1M)": []}
    direct: dict[str, int] = {}
    try:
        for r in range(args.rounds):
            results["dd (O_DIRECT, bs=1M)"].append(tuple(dd(path, nbytes, m) for m in modes))
            for label, handle in handles.items():
                before = handle.get_direct_bytes()
                results.setdefault(label, []).append(tuple(ours(handle, buffer, path, m) for m in modes))
                direct[label] = handle.get_direct_bytes() - before
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        path.unlink(missing_ok=True)

    from rich.console import Console
    from rich.table import Table

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"

    dd_label = "dd (O_DIRECT, bs=1M)"
    dd_medians = [statistics.median(rec[i] for rec in results[dd_label]) for i in range(len(modes))]
    table = Table(title=f"async I/O, {nbytes / (1 << 30):g} GiB in {args.dir}: GB/s, median over {args.rounds} "
                        "rounds [min-max]; (x dd) = ratio to dd's median")
    for col in ("engine", "write new file", "overwrite file", "read", "O_DIRECT share"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for label, recs in results.items():
        cells = []
        for i in range(len(modes)):
            values = [rec[i] for rec in recs]
            cells.append(f"{cell(values)} ({statistics.median(values) / dd_medians[i]:.2f}x dd)")
        share = "100%" if label == dd_label else f"{100 * direct[label] / (len(modes) * nbytes):.0f}%"
        table.add_row(label, *cells, share)
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
