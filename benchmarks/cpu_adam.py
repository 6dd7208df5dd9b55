"""Benchmark dsrun's CPU Adam against torch's AdamW and against the machine's memory bandwidth.

    PYTHONPATH=. python benchmarks/cpu_adam.py [--numel 100000000] [--rounds 3] [--steps 5]

All cores are used (``torch.set_num_threads(os.cpu_count())`` unless ``--threads``). Each round measures,
in the same process:

- the read+write bandwidth of an in-place update (``t.mul_``) of a 400 MB fp32 tensor;
- fp32 params: our DeepSpeedCPUAdam, ``torch.optim.AdamW(fused=True)``, ``AdamW(foreach=True)``;
- bf16 params with fp32 master + fp32 states, bf16 grads: ours (bf16 copy written in the same pass) against
  fused AdamW on the fp32 master (grads upcast first, as fused AdamW needs fp32 grads) plus a separate
  ``bf16.copy_(master)``;
- ``fp32_optimizer_states=False``: bf16 params and bf16 states updated directly; and fp32 params with bf16
  states.

Cases that are compared are allocated together and their steps interleaved (the machine may be shared);
each figure is the median over rounds of the median step time within a round, with the min-max spread over
rounds in brackets. "speed-up vs baseline" divides the baseline's time by the case's, within the same round.
Bytes per parameter count each array read once and written once: fp32 Adam = 4 (grad) + 3 x 8 (param,
exp_avg, exp_avg_sq read and written) = 28 B.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrun.ops.adam import DeepSpeedCPUAdam  # noqa: E402


class Case:
    """One timed update: ``setup(numel)`` allocates and returns the step function."""

    def __init__(self, name: str, bytes_per_param: int, setup: Callable[[int], Callable[[], object]],
                 baseline: str = "fp32 torch AdamW(fused=True)"):
        self.name, self.bytes_per_param, self.setup = name, bytes_per_param, setup
        self.baseline = baseline  # the case in the same group this one is compared with


def _param(numel: int, dtype: torch.dtype) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(numel).to(dtype))
    p.grad = (torch.randn(numel) * 1e-2).to(dtype)
    return p


def bandwidth_probe(numel: int) -> Callable[[], object]:
    t = torch.ones(100_000_000)  # 400 MB, whatever --numel is
    return lambda: t.mul_(0.999999)


def ours(dtype: torch.dtype, fp32_states: bool = True) -> Callable[[int], Callable[[], object]]:
    def setup(numel: int) -> Callable[[], object]:
        p = _param(numel, dtype)
        opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, fp32_optimizer_states=fp32_states)
        assert opt.uses_compiled_op, "the cpu_adam op did not build; see the warning above"
        return opt.step
    return setup


def torch_adamw(**kind: bool) -> Callable[[int], Callable[[], object]]:
    def setup(numel: int) -> Callable[[], object]:
        p = _param(numel, torch.float32)
        return torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kind).step
    return setup


def torch_fused_bf16_with_copy(numel: int) -> Callable[[], object]:
    p = _param(numel, torch.bfloat16)
    master = torch.nn.Parameter(p.detach().float())
    opt = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.01, fused=True)

    def step() -> None:
        master.grad = p.grad.float()  # fused AdamW needs grads in the parameter's dtype
        opt.step()
        p.data.copy_(master.detach())

    return step


BANDWIDTH = Case("in-place update of 400 MB (bandwidth probe)", 8, bandwidth_probe)
FUSED = Case("fp32 torch AdamW(fused=True)", 28, torch_adamw(fused=True))
# Each group is allocated together and its steps are interleaved, so every ratio compares figures taken
# under the same background load (the machine is shared).
GROUPS: list[list[Case]] = [
    [BANDWIDTH, Case("fp32 ours DeepSpeedCPUAdam", 28, ours(torch.float32)), FUSED],
    [BANDWIDTH, Case("fp32 torch AdamW(foreach=True)", 28, torch_adamw(foreach=True)), FUSED],
    [BANDWIDTH, Case("bf16 params, fp32 master+states: ours", 28, ours(torch.bfloat16),
                     baseline="bf16 params: torch fused + grad upcast + bf16 copy"),
     Case("bf16 params: torch fused + grad upcast + bf16 copy", 40, torch_fused_bf16_with_copy), FUSED],
    [BANDWIDTH, Case("bf16 params + bf16 states (fp32_optimizer_states=False): ours", 14,
                     ours(torch.bfloat16, fp32_states=False)),
     Case("fp32 params + bf16 states: ours", 20, ours(torch.float32, fp32_states=False)), FUSED],
]


def run_group(group: list[Case], numel: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each case, the cases' steps interleaved."""
    fns = [case.setup(numel) for case in group]
    for fn in fns:
        fn()  # warm-up: lazy state creation and first touch of its pages
    times: list[list[float]] = [[] for _ in group]
    for _ in range(steps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    del fns
    gc.collect()
    return {case.name: statistics.median(t) for case, t in zip(group, times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="repeat every group this many times")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case and round (interleaved)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = args.numel

    # per case: one record per (round, group it appears in): (seconds, bandwidth GB/s, fused seconds)
    records: dict[str, list[tuple[float, float, float]]] = {}
    for r in range(args.rounds):
        for group in GROUPS:
            result = run_group(group, n, args.steps)
            bw = BANDWIDTH.bytes_per_param * 100_000_000 / result[BANDWIDTH.name] / 1e9
            for case in group:
                if case is BANDWIDTH or (case is FUSED and group is not GROUPS[0]):
                    continue
                records.setdefault(case.name, []).append((result[case.name], bw, result[case.baseline]))
            records.setdefault(BANDWIDTH.name, []).append((result[BANDWIDTH.name], bw, result[FUSED.name]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"CPU Adam, {n / 1e6:g}M params, {args.threads} threads: median over {args.rounds} rounds "
                        f"(min-max in brackets), {args.steps} interleaved steps per round")
    for col in ("case", "ms/step", "Mparams/s", "B/param", "GB/s", "% of bandwidth", "speed-up vs baseline",
                "baseline"):
        table.add_column(col, justify="left" if col == "case" else "right")

    def cell(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"

    bws = [bw for _, bw, _ in records[BANDWIDTH.name]]
    table.add_row(BANDWIDTH.name, "", "", "8", cell(bws, ".1f"), "100%", "", "")
    cases = {c.name: c for g in GROUPS for c in g}
    for name, recs in records.items():
        if name == BANDWIDTH.name:
            continue
        nbytes = cases[name].bytes_per_param
        secs = [s for s, _, _ in recs]
        table.add_row(name, cell([s * 1e3 for s in secs], ".0f"), cell([n / s / 1e6 for s in secs], ".0f"),
                      str(nbytes), cell([nbytes * n / s / 1e9 for s in secs], ".1f"),
                      cell([100 * nbytes * n / s / 1e9 / bw for s, bw, _ in recs], ".0f"),
                      cell([f / s for s, _, f in recs], ".2f"),
                      "fused AdamW" if cases[name].baseline == FUSED.name else "torch fused + copy")
    Console(width=200).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
