"""Model FLOPs utilisation (MFU): the model's FLOPs per second on each device over the device's peak.

**Model FLOPs** follow PaLM's appendix B (Chowdhery et al., 2022, "Model FLOPs utilization"): training one
token of a decoder with ``N`` weights that multiply activations costs ``6·N`` FLOPs (forward ``2·N``,
backward ``4·N``) plus ``12·L·d·T`` for self-attention (``L`` layers, width ``d = heads x head_dim``,
``T`` tokens of context; forward ``QKᵀ`` and ``AV`` are ``2·2·T·d`` per layer, times 3 for forward +
backward). The attention term counts the whole ``T x T`` square, as PaLM does, although a causal kernel
skips about half of it. Activation-checkpoint recompute is **not** counted: MFU measures the model's FLOPs,
not the hardware's (the work a run repeats is its own inefficiency); :func:`train_flops_per_token` is the
whole definition, and ``dsrun.models.accounting.model_step_flops`` applies it to dsrun's GPT.

**The peak** of a device is DeepSpeed's "per GPU": a CUDA device known to :data:`GPU_PEAKS` reads NVIDIA's
dense (no 2:4 sparsity) tensor-core figure for the run's dtype (fp32 reads TF32's when torch lets matmuls use
TF32); any other device, the CPU first, is measured by :func:`measure_matmul_peak`, a short timed GEMM at the
run's dtype and thread count. **MFU** = achieved model FLOP/s per device / peak (:class:`ModelFlopsMeter`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
import torch

from dsrun.monitor.progress import flops_text, format_tflops


@dataclass(frozen=True)
class GpuPeak:
    """One row of the table: the words all of which a device's name must contain (upper case), the name
    printed, and NVIDIA's datasheet figures in TFLOP/s, dense (no 2:4 sparsity); ``fp32`` is without tensor
    cores, ``tf32`` with them."""

    patterns: tuple[str, ...]
    name: str
    bf16: float
    fp16: float
    tf32: float
    fp32: float


GPU_PEAKS: tuple[GpuPeak, ...] = (  # the most specific first: "H100 PCIe" before "H100"
    GpuPeak(("H100", "PCIE"), "NVIDIA H100 PCIe", 756.5, 756.5, 378.0, 51.2),
    GpuPeak(("H100", "NVL"), "NVIDIA H100 NVL", 835.5, 835.5, 417.5, 60.0),
    GpuPeak(("H100",), "NVIDIA H100 SXM", 989.4, 989.4, 494.7, 66.9),
    GpuPeak(("H200", "NVL"), "NVIDIA H200 NVL", 835.5, 835.5, 417.5, 60.0),
    GpuPeak(("GH200",), "NVIDIA GH200", 989.4, 989.4, 494.7, 66.9),
    GpuPeak(("H200",), "NVIDIA H200", 989.4, 989.4, 494.7, 66.9),
    GpuPeak(("A100",), "NVIDIA A100", 312.0, 312.0, 156.0, 19.5),
)


def train_flops_per_token(num_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """PaLM's training FLOPs per token, ``6·N + 12·L·d·T``: ``num_params`` the weights that multiply
    activations (every block's linears and the output head; not the embedding lookups, norms or biases),
    ``n_layer`` attention layers of width ``d_model`` over ``seq_len`` tokens. No recompute."""
    return 6 * num_params + 12 * n_layer * d_model * seq_len


def gpu_peak_tflops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> tuple[float, str] | None:
    """The dense peak (TFLOP/s) and the table's words for it (``"NVIDIA H100 SXM bf16 dense"``) of a GPU
    named ``device_name`` (``torch.cuda.get_device_name()``, e.g. "NVIDIA H100 80GB HBM3") at ``dtype``;
    ``tf32``: fp32 matmuls run on TF32 tensor cores. None for a device the table does not know."""
    name = device_name.upper()
    row = next((row for row in GPU_PEAKS if all(p in name for p in row.patterns)), None)
    if row is None:
        return None
    if dtype == torch.bfloat16:
        return row.bf16, f"{row.name} bf16 dense"
    if dtype == torch.float16:
        return row.fp16, f"{row.name} fp16 dense"
    if dtype == torch.float32:
        return (row.tf32, f"{row.name} tf32 dense") if tf32 else (row.fp32, f"{row.name} fp32")
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        threads: int | None = None, sizes: tuple[int, ...] | None = None,
                        budget_s: float = 0.3) -> float:
    """The best rate (FLOP/s) of square GEMMs at ``dtype`` on ``device`` (with ``threads`` intra-op threads on the
    CPU; None: torch's current setting), one multiply timed at a time, after a warm-up, for about
    ``budget_s / len(sizes)`` seconds (at least 3 times) per size. Best, not mean: the peak is what the device
    can do. On the CPU the sizes are 256, 512 and 1024: a small one runs within one scheduler slice on a shared
    machine, and a large one keeps many threads busy; a size predicted to take over half the budget per
    multiply (a slow dtype) is skipped. A GPU's size is 8192. With one CPU thread a multiply is timed by the
    thread's CPU time, immune to other processes' load; with several, by the clock, which a loaded machine
    stretches (every thread must hold a core at once), so one thread's rate is the floor: there a rank with
    several threads may read a low peak, and a high MFU (``benchmarks/mfu_probe.py --threads N`` shows it)."""
    device = torch.device(device)
    sizes = sizes or ((256, 512, 1024) if device.type == "cpu" else (8192,))
    previous = torch.get_num_threads()
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)
    # one CPU thread multiplies on this very thread: its CPU time leaves out the moments other processes had
    # the core, so a shared machine's load does not lower the peak (several threads are timed by the clock)
    on_one_core = device.type == "cpu" and torch.get_num_threads() == 1
    best = 0.0
    try:
        for size in sizes:
            flops = 2.0 * size ** 3
            if best and flops / best > budget_s / 2:
                break
            a = torch.randn(size, size, device=device).to(dtype)
            b = torch.randn(size, size, device=device).to(dtype)
            out = torch.empty(size, size, device=device, dtype=dtype)
            torch.mm(a, b, out=out)  # warm-up
            _synchronize(device)
            trials, deadline = 0, time.perf_counter() + budget_s / len(sizes)
            while trials < 3 or (time.perf_counter() < deadline and trials < 1000):
                started, cpu_started = time.perf_counter(), time.thread_time()
                torch.mm(a, b, out=out)
                _synchronize(device)
                elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
                if on_one_core and cpu > elapsed / 2:  # less: the work ran elsewhere (or mostly waited): the clock
                    elapsed = cpu
                if elapsed > 0:
                    best = max(best, flops / elapsed)
                trials += 1
    finally:
        torch.set_num_threads(previous)
    if device.type == "cpu" and not on_one_core:  # the floor: what one core does, whatever the load
        best = max(best, measure_matmul_peak(dtype, device, threads=1, sizes=sizes[:1], budget_s=budget_s / 4))
    return best


@dataclass(frozen=True)
class DevicePeak:
    """A device's peak FLOP/s and where it came from: ``"measured"`` or the table's words."""

    flops: float
    source: str

    def line(self) -> str:
        """What a run prints once at start: ``peak (measured): 0.0921 TFLOP/s``."""
        return f"peak ({self.source}): {format_tflops(self.flops / 1e12)} TFLOP/s"


def device_peak(device: torch.device | str, dtype: torch.dtype, threads: int | None = None) -> DevicePeak:
    """The table's peak for a known CUDA GPU, else the matmul probe's on ``device`` itself. A measured peak at a
    16-bit dtype is never below the fp32 one: a CPU without fp16 arithmetic multiplies fp16 at a few GFLOP/s
    while a 16-bit model's other kernels (attention, the loss) compute in fp32 and outpace it, so the dtype's
    own GEMM rate would not bound the model's (MFU over 100%)."""
    device = torch.device(device)
    if device.type == "cuda":
        tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
        known = gpu_peak_tflops(torch.cuda.get_device_name(device), dtype, tf32=tf32)
        if known is not None:
            return DevicePeak(known[0] * 1e12, f"table, {known[1]}")
    peak = measure_matmul_peak(dtype, device, threads=threads)
    if dtype != torch.float32:
        peak = max(peak, measure_matmul_peak(torch.float32, device, threads=threads))
    return DevicePeak(peak, "measured")


@dataclass(frozen=True)
class FlopsRate:
    """Achieved model TFLOP/s per device and MFU (a fraction of the peak) over some steps."""

    tflops_per_device: float
    mfu: float

    def events(self, step: int) -> list[tuple[str, float, int]]:
        """The monitor events: ``Train/Samples/tflops_per_device`` and ``Train/Samples/mfu`` (a fraction)."""
        return [("Train/Samples/tflops_per_device", self.tflops_per_device, step),
                ("Train/Samples/mfu", self.mfu, step)]

    def text(self) -> str:
        """The progress line's part: ``0.0123 TFLOP/s | MFU 41.2%``."""
        return flops_text(self.tflops_per_device, self.mfu)


@dataclass(frozen=True)
class ModelFlopsMeter:
    """The model FLOPs of one unit of training, every rank's together (``dsrun train``: one optimizer step; the
    engine's observer, whose batch may change: one sample), the peak of one device, and how many devices share
    the work (the world size: data, pipeline, sequence and model parallel ranks alike)."""

    flops_per_step: float
    peak: DevicePeak
    devices: int

    def rate(self, steps: float, elapsed_s: float) -> FlopsRate | None:
        """Over ``steps`` units (optimizer steps, or samples) in ``elapsed_s`` seconds; None when no time passed."""
        if elapsed_s <= 0 or not math.isfinite(elapsed_s):
            return None
        per_device = steps * self.flops_per_step / elapsed_s / self.devices
        return FlopsRate(per_device / 1e12, per_device / self.peak.flops if self.peak.flops > 0 else 0.0)

