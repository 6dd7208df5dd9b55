"""Block-sparse attention against dense attention: peak memory and time of one forward + backward.

    PYTHONPATH=. python benchmarks/sparse_attention.py [--device cpu|cuda] [--seq 4096] [--batch 1] [--heads 4]
                                                      [--head-dim 64] [--repeats 5] [--json out.json]

For each layout (every one at most 10% dense at the default sequence), three ways to compute attention of
the same q, k, v ``[batch, heads, seq, head_dim]`` (fp32; bf16 with ``--dtype bf16``):

* ``sparse``: dsrun's ``block_sparse_attention`` over the layout's non-zero blocks;
* ``dense+mask``: the same attention written densely (scores, -inf outside the layout, softmax, context),
  which is what attention with an arbitrary mask costs (``scaled_dot_product_attention`` with a mask and
  any dropout also materialises the scores);
* ``sdpa``: torch's fused ``scaled_dot_product_attention`` with no mask (full attention, flash kernels):
  the fastest dense baseline.

Memory is the peak bytes of tensor storage alive during forward + backward, inputs excluded
(:class:`dsrun.profiling.tensor_memory.TensorMemoryTracker`, exact; on CUDA the allocator's peak is printed
too). Time is the median over ``--repeats`` rounds, the three run back to back in each round, after one
warm-up round; a speed ratio is the median of the per-round ratios (each compares runs taken under the same
background load). The load average is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrun.ops.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig,  # noqa: E402
                                        LocalSlidingWindowSparsityConfig, VariableSparsityConfig, block_index,
                                        block_sparse_attention)
from dsrun.profiling.tensor_memory import TensorMemoryTracker  # noqa: E402

LAYOUTS = {
    "bslongformer w3 g[0] b64": lambda h: BSLongformerSparsityConfig(h, block=64, num_sliding_window_blocks=3),
    "bigbird r1 w3 g1 b64": lambda h: BigBirdSparsityConfig(h, block=64, num_random_blocks=1),
    "variable r1 w[4] g[0] b32": lambda h: VariableSparsityConfig(h, block=32, num_random_blocks=1),
    "local sliding w5 b32 causal": lambda h: LocalSlidingWindowSparsityConfig(h, block=32, num_sliding_window_blocks=5),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, int, int | None]:
    """(seconds, peak tensor bytes, CUDA allocator peak above the start or None) of forward + backward."""
    synchronize(device)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    out.backward(torch.ones_like(out))
    synchronize(device)
    seconds = time.perf_counter() - start
    allocator = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    del out
    with TensorMemoryTracker() as memory:
        out = fn()
        out.backward(torch.ones_like(out))
    return seconds, memory.peak, allocator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    load = os.getloadavg()
    print(f"device {device}, dtype {args.dtype}, batch {args.batch}, heads {args.heads}, seq {args.seq}, "
          f"head_dim {args.head_dim}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {load[0]:.1f}")
    torch.manual_seed(0)
    random.seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    rows = []
    for name, make in LAYOUTS.items():
        config = make(args.heads)
        layout = config.make_layout(args.seq)
        causal = getattr(config, "attention", "") == "unidirectional"
        index = block_index(layout, config.block, causal=causal, device=device)
        density = index.nnz / layout.numel()
        mask = layout.bool().repeat_interleave(config.block, 1).repeat_interleave(config.block, 2).to(device)

        def dense_masked() -> torch.Tensor:
            scores = (q @ k.transpose(-1, -2)) * args.head_dim ** -0.5
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v

        cases = {"sparse": lambda: block_sparse_attention(q, k, v, index, causal=causal),
                 "dense+mask": dense_masked,
                 "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        times: dict[str, list[float]] = {case: [] for case in cases}
        peaks: dict[str, tuple[int, int | None]] = {}
        for round_ in range(args.repeats + 1):
            for case, fn in cases.items():
                seconds, peak, allocator = measure(fn, device)
                for t in (q, k, v):
                    t.grad = None
                if round_:
                    times[case].append(seconds)
                peaks[case] = (peak, allocator)
        med = {case: statistics.median(ts) for case, ts in times.items()}
        speedup = {case: statistics.median(a / b for a, b in zip(times[case], times["sparse"]))
                   for case in ("sdpa", "dense+mask")}  # per round: baseline time / sparse time
        row = {"layout": name, "density": density, "times_s": med, "sparse_speedup": speedup,
               "peak_bytes": {case: p[0] for case, p in peaks.items()},
               "allocator_peak_bytes": {case: p[1] for case, p in peaks.items()}}
        rows.append(row)
        mib = {case: p[0] / 2**20 for case, p in peaks.items()}
        print(f"\n{name}: density {density:.1%} ({index.nnz} of {layout.numel()} blocks)")
        for case in cases:
            extra = f", allocator peak {peaks[case][1] / 2**20:.1f} MiB" if peaks[case][1] is not None else ""
            print(f"  {case:>10}: {med[case] * 1000:9.1f} ms  peak {mib[case]:8.1f} MiB{extra}")
        print(f"  sparse memory: 1/{mib['dense+mask'] / mib['sparse']:.1f} of dense+mask, "
              f"{mib['sparse'] / mib['sdpa']:.2f}x sdpa's; sparse is {speedup['sdpa']:.2f}x as fast as sdpa and "
              f"{speedup['dense+mask']:.2f}x as fast as dense+mask (medians of per-round ratios)")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "load_average": load,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
