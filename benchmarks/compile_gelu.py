"""Exact GELU and its backward on one CPU thread: eager (oneDNN), eager without oneDNN (ATen's vectorized kernel)
and ``torch.compile`` (inductor's C++ kernel, at its picked ISA and at ``cpp.simdlen=256``), over a size sweep.

Why ``compile.enabled`` gains little on the default GPT (docs/performance.md, "`torch.compile`"): eager's
``F.gelu`` and ``gelu_backward`` on contiguous fp32 CPU tensors run oneDNN's JIT eltwise ``gelu_erf`` kernels,
while inductor inlines ATen's ``Vectorized<float>::erf`` (a rational approximation with a division and a Sleef
``exp`` call per vector), the same code ATen runs with oneDNN off. CPU time per call (``time.thread_time``),
min and median of ``--reps`` calls, in ms; the compiled figures include the compiled call's own overhead (guards,
wrapper, output allocation), which a size sweep separates from the per-element cost.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/compile_gelu.py [--sizes 65536 786432 4194304] [--reps 100]

``--step VARIANT`` measures instead the default GPT's whole training step (one process, one thread, CPU time of
forward + backward + AdamW, medians), eager against ``compiled`` and one variant taking turns step by step:
``gelu_aten`` (inductor's decomposition table without ``aten.gelu``/``aten.gelu_backward``, so the graph calls
ATen's, i.e. oneDNN's, kernels), ``compiled_autograd``, ``sdpa_math`` (traced under the math SDPA backend; run
without ``compiled``, which would share its dynamo cache entry), ``max_autotune``:

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/compile_gelu.py --step gelu_aten [--steps 12]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

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


def step_variants(variant: str, steps: int) -> None:
    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from torch._dynamo import compiled_autograd
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dsrun.models.gpt import GPT

    aten = torch.ops.aten
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf/model/gpt-nano.yaml").read_text())
    spec.pop("_target_")

    def gelu_to_aten(gm, example_inputs):
        table = {op: fn for op, fn in select_decomp_table().items()
                 if getattr(op, "overloadpacket", None) not in (aten.gelu, aten.gelu_backward)}
        return compile_fx(gm, example_inputs, decompositions=table)

    compile_args = {"compiled": {}, "gelu_aten": {"backend": gelu_to_aten}, "compiled_autograd": {},
                    "sdpa_math": {}, "max_autotune": {"mode": "max-autotune-no-cudagraphs"}}
    # the on-disk caches key on the traced graph, not on a custom backend's decomposition table: a variant could
    # load the default compile's kernels (the GELU variant did, until these were off)
    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    modes = ["eager"] + (["compiled"] if variant not in ("compiled", "sdpa_math") else []) + [variant]
    models, optimizers = {}, {}
    for mode in modes:
        torch.manual_seed(0)
        models[mode] = GPT(**spec)
        if mode != "eager":
            models[mode].compile(**compile_args[mode])
        optimizers[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    for it in range(3 + steps):  # the first steps compile
        tokens = torch.randint(0, int(spec["vocab_size"]), (16, int(spec["block_size"]) + 1), generator=gen)
        for mode in modes:
            sdpa = sdpa_kernel(SDPBackend.MATH) if mode == "sdpa_math" else contextlib.nullcontext()
            backward = (compiled_autograd._enable(torch.compile(backend="inductor")) if mode == "compiled_autograd"
                        else contextlib.nullcontext())
            start = time.thread_time_ns()
            with sdpa:
                loss = models[mode](tokens[:, :-1], tokens[:, 1:])
                with backward:
                    loss.backward()
            optimizers[mode].step()
            optimizers[mode].zero_grad(set_to_none=True)
            if it >= 3:
                cpu[mode].append((time.thread_time_ns() - start) / 1e6)
    eager = statistics.median(cpu["eager"])
    for mode in modes:
        print(f"{mode:<18} CPU ms/step {statistics.median(cpu[mode]):8.2f}  speedup over eager "
              f"{eager / statistics.median(cpu[mode]):.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 262144, 786432, 4194304])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--step", choices=["compiled", "gelu_aten", "compiled_autograd", "sdpa_math", "max_autotune"])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.step:
        step_variants(args.step, args.steps)
        return
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
