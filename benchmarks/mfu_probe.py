"""The CPU peak that ``dsrun train`` prints (``peak (measured): X TFLOP/s``) against a sustained matmul rate.

The run's probe (:func:`dsrun.profiling.mfu.measure_matmul_peak`) times one GEMM (256, 512 and 1024 square) at
a time for about 0.3 s in all and keeps the best rate. This benchmark measures the machine's matmul rate the long way, at the same
dtype and threads: square GEMMs of several sizes, each multiplied back to back for ``--seconds`` seconds,
the rate of the best size per second of wall time and per second of the process's CPU time (the rate with
the cores to itself, even on a shared machine); then it runs the probe ``--repeats`` times, alternating with
the long measurement, and prints each pair and the medians of probe / CPU-time rate and probe / wall rate.

    python benchmarks/mfu_probe.py [--dtype fp32|bf16|fp16] [--threads 1] [--seconds 3] [--repeats 3]
                                   [--json out.json]

Target (issue 41): the probe within 20% of the measured rate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dsrun.profiling.mfu import measure_matmul_peak

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sustained_rate(dtype: torch.dtype, seconds: float, threads: int,
                   sizes: tuple[int, ...] = (256, 512, 1024, 2048)) -> tuple[float, float]:
    """FLOP/s of back-to-back GEMMs for ``seconds`` per size (after one warm-up), the best size's: per second
    of wall time, and per second of this process's CPU time x ``threads`` (a shared machine's other
    processes take the core away now and then; the CPU time does not count those moments, so it is the rate
    with the cores to itself, which is what a peak means, without needing an idle machine)."""
    wall_rate = cpu_rate = 0.0
    for size in sizes:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        out = torch.empty(size, size, dtype=dtype)
        torch.mm(a, b, out=out)
        flops, count = 2.0 * size ** 3, 0
        started, cpu_started = time.perf_counter(), time.process_time()
        while time.perf_counter() - started < seconds:
            torch.mm(a, b, out=out)
            count += 1
        wall_rate = max(wall_rate, count * flops / (time.perf_counter() - started))
        cpu_rate = max(cpu_rate, count * flops * threads / (time.process_time() - cpu_started))
    return wall_rate, cpu_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a dsrun train rank's share)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per size, for the sustained rate")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the pairs and the median ratio here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    pairs = []
    for repeat in range(args.repeats):
        sustained, cpu_rate = sustained_rate(dtype, args.seconds, args.threads)
        probe = measure_matmul_peak(dtype, threads=args.threads)
        pairs.append({"probe_tflops": probe / 1e12, "sustained_tflops": sustained / 1e12,
                      "cpu_time_tflops": cpu_rate / 1e12, "ratio": probe / cpu_rate,
                      "ratio_to_sustained": probe / sustained})
        print(f"repeat {repeat + 1}: probe {probe / 1e12:.4f} TFLOP/s | sustained {sustained / 1e12:.4f} "
              f"(per CPU second {cpu_rate / 1e12:.4f}) TFLOP/s | probe / per CPU second {probe / cpu_rate:.3f} | "
              f"probe / sustained {probe / sustained:.3f}", flush=True)
    median = statistics.median(p["ratio"] for p in pairs)
    print(f"{args.dtype}, {args.threads} thread(s): median probe / per CPU second = {median:.3f}, probe / sustained = "
          f"{statistics.median(p['ratio_to_sustained'] for p in pairs):.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"dtype": args.dtype, "threads": args.threads, "pairs": pairs, "median_ratio": median},
                      handle, indent=2)


if __name__ == "__main__":
    main()
