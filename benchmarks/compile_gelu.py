"""Exact GELU and its backward on one CPU thread: eager (oneDNN), eager without oneDNN (ATen's vectorized kernel)
and ``torch.compile`` (inductor's C++ kernel, at its picked ISA and at ``cpp.simdlen=256``), over a size sweep.

Why ``compile.enabled`` gains little on the default GPT (docs/performance.md, "`torch.compile`"): eager's
``F.gelu`` and ``gelu_backward`` on contiguous fp32 CPU tensors run oneDNN's JIT eltwise ``gelu_erf`` kernels,
while inductor inlines ATen's ``Vectorized<float>::erf`` (a rational approximation with a division and a Sleef
``exp`` call per vector), the same code ATen runs with oneDNN off. CPU time per call (``time.thread_time``),
min and median of ``--reps`` calls, in ms; the compiled figures include the compiled call's own overhead (guards,
wrapper, output allocation), which a size sweep separates from the per-element cost.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/compile_gelu.py [--sizes 65536 786432 4194304] [--reps 100]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F


def cpu_ms(fn, reps: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - start)
    times.sort()
    return times[0] / 1e6, times[len(times) // 2] / 1e6


def gelu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad, x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 262144, 786432, 4194304])
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    inputs = {}
    for n in args.sizes:
        gen = torch.Generator().manual_seed(n)
        inputs[n] = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    rows: dict[tuple[int, str], tuple] = {}
    for n, (x, grad) in inputs.items():
        rows[n, "eager (oneDNN)"] = cpu_ms(lambda: gelu(x), args.reps), cpu_ms(lambda: gelu_backward(grad, x), args.reps)
        with torch.backends.mkldnn.flags(enabled=False):
            rows[n, "eager (ATen, no oneDNN)"] = (cpu_ms(lambda: gelu(x), args.reps),
                                                  cpu_ms(lambda: gelu_backward(grad, x), args.reps))
    for name, patch in (("compiled", {}), ("compiled simdlen=256", {"cpp.simdlen": 256})):
        torch._dynamo.reset()  # each variant traces and builds its own kernels under its own inductor config
        with inductor_config.patch(patch):
            fwd, bwd = torch.compile(gelu, dynamic=False), torch.compile(gelu_backward, dynamic=False)
            for n, (x, grad) in inputs.items():
                rows[n, name] = cpu_ms(lambda: fwd(x), args.reps), cpu_ms(lambda: bwd(grad, x), args.reps)
    print(f"ISA picked by inductor: {torch._inductor.cpu_vec_isa.pick_vec_isa()}; ATen: "
          f"{torch.backends.cpu.get_cpu_capability()}; CPU ms per call, min/median of {args.reps}")
    print(f"{'elements':>9} {'variant':<24} {'gelu':>13} {'gelu_backward':>15}")
    for (n, name), (f_ms, b_ms) in sorted(rows.items(), key=lambda item: item[0][0]):
        print(f"{n:>9} {name:<24} {f_ms[0]:6.3f}/{f_ms[1]:6.3f} {b_ms[0]:7.3f}/{b_ms[1]:7.3f}")


if __name__ == "__main__":
    main()
