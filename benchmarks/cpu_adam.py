"""Benchmark dsrun's CPU Adam against torch's AdamW and against the machine's memory bandwidth.

    PYTHONPATH=. python benchmarks/cpu_adam.py [--numel 100000000] [--rounds 3] [--steps 5]

All cores are used (``torch.set_num_threads(os.cpu_count())`` unless ``--threads``). Every case is AdamW
with lr=1e-3, weight_decay=0.01 on one tensor of ``--numel`` parameters. Cases are measured in groups; a
group's tensors are allocated together and its cases' steps interleaved (A B C A B C ...), so each ratio
compares steps taken under the same background load (the machine may be shared). Every group also runs
the bandwidth probe: an in-place update (``t.mul_``) of a 400 MB fp32 tensor, which reads and writes each
byte once (8 B per element).

Bytes per parameter count each array read once and written once, e.g. fp32 AdamW = grad 4 (read) +
param, exp_avg, exp_avg_sq 3 x (4 read + 4 write) = 28 B. A case that moves B bytes per parameter can be at
most 28/B times faster than fp32 fused AdamW when both run at the memory bandwidth: the "ceiling" column.

Reported per case: the median step time over all rounds and steps, Mparams/s, GB/s (B x params / time),
that GB/s as % of the probe's bandwidth measured in the same group, and the speed-up over its baseline as the
median of the per-step ratios (baseline step / case step, the two steps taken back to back), with the
min-max of the per-round medians in brackets, next to the issue's target. The load average is printed.

The "huge-page states" row runs ours with ``DSRUN_OPTIM_HUGE_PAGES=1`` (states, and the fp32 master of a
16-bit parameter, in 2 MiB-aligned memory advised MADV_HUGEPAGE; off by default). Params and grads always
come from torch's allocator (4 KiB pages unless ``THP_MEM_ALLOC_ENABLE=1`` is in the environment, which gives
every large torch tensor huge pages, torch's AdamW states included).
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
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsrun.ops.adam import DeepSpeedCPUAdam  # noqa: E402

FUSED_NAME = "torch AdamW(fused=True): fp32 params+grads+states"


class Case:
    """One timed update: ``setup(numel)`` allocates and returns the step function."""

    def __init__(self, name: str, bytes_per_param: int, setup: Callable[[int], Callable[[], object]],
                 baseline: str = FUSED_NAME, target: float | None = None):
        self.name, self.bytes_per_param, self.setup = name, bytes_per_param, setup
        self.baseline = baseline  # the case of the same group this one is compared with
        self.target = target  # the speed-up target over the baseline, if any


def _param(numel: int, dtype: torch.dtype) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(numel).to(dtype))
    p.grad = (torch.randn(numel) * 1e-2).to(dtype)
    return p


def bandwidth_probe(numel: int) -> Callable[[], object]:
    t = torch.ones(100_000_000)  # 400 MB, whatever --numel is
    return lambda: t.mul_(0.999999)


def ours(param_dtype: torch.dtype, fp32_states: bool = True, huge_pages: bool = False
         ) -> Callable[[int], Callable[[], object]]:
    def setup(numel: int) -> Callable[[], object]:
        p = _param(numel, param_dtype)
        opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, fp32_optimizer_states=fp32_states)
        assert opt.uses_compiled_op, "the cpu_adam op did not build; see the warning above"
        with mock.patch.dict(os.environ, {"DSRUN_OPTIM_HUGE_PAGES": "1" if huge_pages else "0"}):
            opt.step()  # creates the states now, with the setting above
        return opt.step
    return setup


def torch_adamw(dtype: torch.dtype = torch.float32, **kind: bool) -> Callable[[int], Callable[[], object]]:
    def setup(numel: int) -> Callable[[], object]:
        p = _param(numel, dtype)  # torch's states take the parameter's dtype
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
FUSED = Case(FUSED_NAME, 28, torch_adamw(fused=True))
BF16_COPY = "torch fused on fp32 master + grad upcast + bf16 copy"
TORCH_BF16 = "torch AdamW(fused=True): bf16 params+grads+states"
# Each group is allocated together and its steps are interleaved, so every ratio compares figures taken
# under the same background load. The probe runs in every group.
GROUPS: list[list[Case]] = [
    [Case("ours: fp32 params+grads+states", 28, ours(torch.float32), target=1.0), FUSED],
    [Case("ours: fp32, huge-page states (DSRUN_OPTIM_HUGE_PAGES=1)", 28, ours(torch.float32, huge_pages=True),
          target=1.0), FUSED],
    [Case("torch AdamW(foreach=True): fp32", 28, torch_adamw(foreach=True)), FUSED],
    # bf16 parameters, fp32 master + states: ours writes the bf16 copy in the same pass. Torch needs the grad
    # upcast (4 B write + read), the fp32 step (28 B) and a separate copy (4 B read + 2 B write) = 40 B.
    [Case("ours: bf16 params+grads, fp32 master+states", 28, ours(torch.bfloat16), baseline=BF16_COPY, target=1.3),
     Case(BF16_COPY, 40, torch_fused_bf16_with_copy), FUSED],
    # fp32_optimizer_states=False as DeepSpeed defines it: states in the parameter's dtype, so bf16 params ->
    # bf16 states, no master copy: 2 + 3 x (2 + 2) = 14 B per parameter.
    [Case("ours fp32_optimizer_states=False: bf16 params+grads+states", 14, ours(torch.bfloat16, fp32_states=False),
          target=1.5),
     Case(TORCH_BF16, 14, torch_adamw(torch.bfloat16, fused=True)), FUSED],
    [Case("ours fp32_optimizer_states=False: bf16 params+grads+states vs torch bf16", 14,
          ours(torch.bfloat16, fp32_states=False), baseline=TORCH_BF16),
     Case(TORCH_BF16, 14, torch_adamw(torch.bfloat16, fused=True))],
    # our extension: fp32 params keep fp32 values with bf16 states: 4 + 8 + 2 x 4 = 20 B (at most 1.4x)
    [Case("ours fp32_optimizer_states=False: fp32 params+grads, bf16 states", 20,
          ours(torch.float32, fp32_states=False)), FUSED],
]


def run_group(group: list[Case], numel: int, steps: int) -> dict[str, list[float]]:
    """Seconds of every step of each case (and of the probe), the cases' steps interleaved."""
    cases = [BANDWIDTH, *group]
    fns = [case.setup(numel) for case in cases]
    for fn in fns:
        fn()  # warm-up: lazy state creation and first touch of its pages
    times: dict[str, list[float]] = {case.name: [] for case in cases}
    for _ in range(steps):
        for case, fn in zip(cases, fns):
            t0 = time.perf_counter()
            fn()
            times[case.name].append(time.perf_counter() - t0)
    del fns
    gc.collect()
    return times


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=3, help="repeat every group this many times")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case and round (interleaved)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--groups", default="", help="comma-separated indices of the groups to run (default: all); "
                                                      "0 = fp32, 1 = fp32 with huge-page states, 2 = foreach, "
                                                      "3 = bf16 params, 4-5 = bf16 states, 6 = fp32 + bf16 states")
    args = parser.parse_args(argv)
    groups = [GROUPS[int(i)] for i in args.groups.split(",")] if args.groups else GROUPS
    torch.set_num_threads(args.threads)
    n = args.numel
    loads = [_load()]

    # per (group index, case name): step seconds, per-step ratios to the baseline, per-round median ratios,
    # and the probe's GB/s of the same steps
    secs: dict[tuple[int, str], list[float]] = {}
    ratios: dict[tuple[int, str], list[float]] = {}
    round_ratios: dict[tuple[int, str], list[float]] = {}
    probe_gbs: dict[int, list[float]] = {}
    for r in range(args.rounds):
        for gi, group in enumerate(groups):
            times = run_group(group, n, args.steps)
            probe_gbs.setdefault(gi, []).extend(BANDWIDTH.bytes_per_param * 100_000_000 / t / 1e9
                                                for t in times[BANDWIDTH.name])
            for case in group:
                key = (gi, case.name)
                secs.setdefault(key, []).extend(times[case.name])
                if case.baseline in times and case.baseline != case.name:
                    rs = [b / c for b, c in zip(times[case.baseline], times[case.name])]
                    ratios.setdefault(key, []).extend(rs)
                    round_ratios.setdefault(key, []).append(statistics.median(rs))
        loads.append(_load())
        print(f"round {r + 1}/{args.rounds} done, load average {loads[-1]}", file=sys.stderr)

    from rich.console import Console
    from rich.table import Table

    all_probe = [g for v in probe_gbs.values() for g in v]
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    table = Table(title=f"CPU AdamW, {n / 1e6:g}M params, {args.threads} threads, {args.rounds} rounds x {args.steps} "
                        f"interleaved steps; median \\[min-max of round medians]; torch {torch.__version__}, "
                        f"THP_MEM_ALLOC_ENABLE={thp}; load average (1/5/15 min) {loads[0]} at start, "
                        f"{loads[-1]} at end")
    for col in ("case", "B/param", "ms/step", "Mparams/s", "GB/s", "% of bandwidth", "speed-up", "target",
                "ceiling", "baseline"):
        table.add_column(col, justify="left" if col in ("case", "baseline") else "right")
    table.add_row(BANDWIDTH.name, "8", "", "", f"{statistics.median(all_probe):.1f}", "100%", "", "", "", "")
    short = {FUSED_NAME: "fused AdamW fp32", BF16_COPY: "torch fused + copy", TORCH_BF16: "fused AdamW bf16"}
    printed = set()
    for gi, group in enumerate(groups):
        bw = statistics.median(probe_gbs[gi])
        for case in group:
            key = (gi, case.name)
            if case.name in printed and key not in ratios:
                continue  # a baseline shared by several groups is shown once
            printed.add(case.name)
            s = statistics.median(secs[key])
            nbytes = case.bytes_per_param
            gbs = nbytes * n / s / 1e9
            if key in ratios:
                rr = round_ratios[key]
                speedup = f"{statistics.median(ratios[key]):.2f}x \\[{min(rr):.2f}-{max(rr):.2f}]"
                base = next(c for c in group if c.name == case.baseline)
                ceiling = f"{base.bytes_per_param / nbytes:.2f}x"
                baseline = short.get(case.baseline, case.baseline)
            else:
                speedup, ceiling, baseline = "", "", ""
            target = f">= {case.target:g}x" if case.target else ""
            table.add_row(case.name, str(nbytes), f"{s * 1e3:.0f}", f"{n / s / 1e6:.0f}", f"{gbs:.1f}",
                          f"{100 * gbs / bw:.0f}%", speedup, target, ceiling, baseline)
    Console(width=220).print(table)
    print("bandwidth probe per group (GB/s, median): "
          + ", ".join(f"{statistics.median(v):.1f}" for v in probe_gbs.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
