"""The one-GPU check: everything docs/cuda.md and docs/performance.md report from a lent GPU, in one command.

    python benchmarks/gpu_check.py --json gpu_check.json      # one CUDA GPU, NCCL, a world of one; < 8 minutes
    python benchmarks/gpu_check.py --smoke --json smoke.json  # the same sections on the CPU, tiny sizes, gloo
    python benchmarks/gpu_check.py --fetch-wheels .whl        # here: the wheels of dsrun's needs the GPU image lacks

Sections, in this order (``--only`` picks some):

- ``env``: torch, CUDA, NCCL, the device, and dsrun's imports that are missing.
- ``parity``: ``benchmarks/cuda_paths.py``'s parity cases (ZeRO stages 0-3 in fp32/bf16/fp16, accumulation,
  clipping, a checkpoint round trip, CPU and NVMe offload) against the plain PyTorch loop; ``--smoke``: fp32 and
  bf16 at stages 0-3 only.
- ``mfu``: the model FLOPs utilisation of a 1.0B-parameter dsrun GPT (18 x 2048, vocab 50304, 2048 tokens) in
  bf16 at ZeRO stages 0 and 3: PaLM's FLOPs per step (``dsrun.models.accounting.model_step_flops``) over the median
  step time and the device's dense peak (``engine.set_model_flops``: the GPU table of ``dsrun.profiling.mfu``).
  Target (issue 41): at least 40% on an H100/H200.
- ``vs_fsdp2``: median step time of the 124M GPT of docs/cuda.md (12 x 768, 8 x 1024 tokens, bf16): plain
  PyTorch (autocast, fused AdamW), dsrun ZeRO 0-3, and PyTorch's FSDP2 (``fully_shard`` per block and the root,
  bf16 parameters, fp32 reduction, fused AdamW) on the same device.
- ``compile``: the same GPT eager and with ``compile.enabled`` (inductor) at ZeRO 0 and 3: step time, the first
  step's seconds (the compilation), dynamo's graph-break count.

Every section runs in a process of its own, forked from this one, with a time box: the sections share one
budget (``--budget``, seconds from the start); a section is skipped, with its reason in the JSON, when less is
left than it needs, and killed (its finished rows kept) when it overruns. A failure is a row's or a section's
``error``; the run goes on. The JSON holds every row; the tables for the docs are printed at the end.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The sections are forked from this process, which must not have initialised CUDA: with this set, a
# torch.cuda.is_available() asks NVML instead of the CUDA driver (which a forked child could not use again).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

import cuda_paths  # noqa: E402  (the parity cases, the plain PyTorch loops and the timing)

SCHEMA = "dsrun.gpu_check/1"
# dsrun's imports for an in-process engine; the GPU image ships torch, numpy and pyyaml but not these
NEEDED_MODULES = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "hjson", "yaml", "numpy")
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "hjson")


@dataclass(frozen=True)
class Sizes:
    """What each section runs: the GPU's sizes or ``--smoke``'s tiny ones."""

    parity_prefixes: tuple[str, ...] | None  # None: every case of cuda_paths.parity_cases()
    mfu_model: dict[str, int]  # dsrun GPT keyword arguments; block_size is the sequence length
    mfu_micros: tuple[int, ...]  # tried in turn until one fits the device
    mfu_stages: tuple[int, ...]
    perf: dict[str, int]  # layers, width, seq, micro, vocab
    steps: int
    warmup: int
    compile_backend: str
    compile_stages: tuple[int, ...]


GPU = Sizes(parity_prefixes=None,
            mfu_model={"vocab_size": 50304, "block_size": 2048, "n_layer": 18, "n_head": 16, "n_embd": 2048},
            mfu_micros=(8, 4), mfu_stages=(0, 3),
            perf={"layers": 12, "width": 768, "seq": 1024, "micro": 8, "vocab": 50304},
            steps=10, warmup=3, compile_backend="inductor", compile_stages=(0, 3))
SMOKE = Sizes(parity_prefixes=("fp32/", "bf16/"),
              mfu_model={"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64},
              mfu_micros=(2,), mfu_stages=(0, 3), perf={"layers": 2, "width": 64, "seq": 32, "micro": 2, "vocab": 128},
              steps=3, warmup=1, compile_backend="eager", compile_stages=(0, 3))


class Section:
    """A running section's side: its device and sizes, its deadline, and the rows it reports."""

    def __init__(self, sizes: Sizes, device: torch.device, deadline: float, out: Path) -> None:
        self.sizes, self.device, self.deadline, self.out = sizes, device, deadline, out

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def emit(self, row: dict, kind: str = "row") -> None:
        text = json.dumps({"kind": kind, **row}, default=str)
        with self.out.open("a") as handle:
            handle.write(text + "\n")
        print(f"[gpu_check] {text}", flush=True)

    def fits(self, label: str, need_s: float) -> bool:
        """Whether ``need_s`` seconds are left; if not, report ``label`` skipped with the reason."""
        if self.left() >= need_s:
            return True
        self.emit({"case": label, "skipped": f"budget: {self.left():.1f} s left, needs ~{need_s:.1f} s"})
        return False

    def sync(self) -> None:
        cuda_paths.synchronize(self.device)

    def peak_gib(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if self.device.type == "cuda" else None

    def release(self) -> None:
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def error_of(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc(limit=8)[-4000:]}


def close(engine) -> None:
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()


# --- the sections ------------------------------------------------------------------------------------------
def run_env(s: Section) -> None:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if s.device.type == "cuda" else platform.processor() or "cpu",
            "backend": torch.distributed.get_backend(),
            "missing_modules": [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]}
    if s.device.type == "cuda":
        info["nccl"] = str(torch.cuda.nccl.version())
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
    s.emit(info)


def run_parity(s: Section) -> None:
    refs: dict = {}
    for name, case in cuda_paths.parity_cases().items():
        if s.sizes.parity_prefixes is not None and not name.startswith(s.sizes.parity_prefixes):
            continue
        if s.fits(name, 2.0):
            row = cuda_paths.parity_row(name, case, refs, str(s.device))
            s.emit(row)
            s.release()


def run_mfu(s: Section) -> None:
    for stage in s.sizes.mfu_stages:
        for micro in s.sizes.mfu_micros:
            label = f"stage{stage}/micro{micro}"
            if not s.fits(label, 20.0 if s.device.type == "cuda" else 1.0):
                return
            row = mfu_case(s, stage, micro)
            s.release()
            s.emit(row)
            if "out of memory" not in row.get("error", ""):
                break  # it fitted (or failed otherwise): the next stage; out of memory: the next, smaller micro-batch


def mfu_case(s: Section, stage: int, micro: int) -> dict:
    """One timed run of the MFU model: the median step, PaLM's FLOPs per step over it and the device's peak
    (``engine.set_model_flops``'s: the GPU table, or the CPU's measured matmul), and the engine's own meter."""
    import dsrun
    from dsrun.models.accounting import model_step_flops, num_parameters
    from dsrun.models.gpt import GPT
    from dsrun.profiling.mfu import ModelFlopsMeter

    shape = s.sizes.mfu_model
    seq = shape["block_size"]
    row: dict = {"case": f"stage{stage}/micro{micro}", "stage": stage, "micro": micro, "seq": seq, **shape}
    engine = None
    try:
        torch.manual_seed(0)
        with torch.device(s.device):
            model = GPT(**shape)
        row["params"] = num_parameters(model)
        flops_per_step = model_step_flops(model.config, micro, seq)
        engine, _, _, _ = dsrun.initialize(model=model, config=cuda_paths.perf_config(stage, micro))
        data = []
        for i in range(2):
            tokens = cuda_paths.batch(i, micro, s.device, shape["vocab_size"], seq + 1)
            data.append((tokens[:, :-1], tokens[:, 1:]))
        step = cuda_paths.engine_step(engine, data)
        for _ in range(s.sizes.warmup):
            step()
        s.sync()
        engine.set_model_flops(flops_per_step / micro)  # after the warm-up: the engine's window is the timed steps
        peak = engine.observer.flops_meter.peak
        step_s = cuda_paths.timed_steps(step, s.sizes.steps, 0, s.device)
        rate = ModelFlopsMeter(flops_per_step, peak, 1).rate(1, step_s)
        engine_rate = engine.observer.flops_rate()
        row.update(step_s=round(step_s, 4), flops_per_step=flops_per_step,
                   tflops=round(rate.tflops_per_device, 1), mfu=round(rate.mfu, 4),
                   engine_mfu=None if engine_rate is None else round(engine_rate.mfu, 4),
                   peak_tflops=round(peak.flops / 1e12, 1), peak_source=peak.source, peak_gib=s.peak_gib())
    except Exception as exc:
        row.update(error_of(exc))
    finally:
        close(engine)
    return row


def fsdp2_step(net: torch.nn.Module, data: list[torch.Tensor], device: torch.device) -> Callable[[], None]:
    """PyTorch's FSDP2 over ``net`` (cuda_paths' GPT): ``fully_shard`` each block, then the root (the tied
    embedding and head, the final norm); bf16 parameters, fp32 gradient reduction, AdamW (fused on CUDA)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in net.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device.type == "cuda")
    it = iter(range(10 ** 9))

    def step() -> None:
        loss = net(data[next(it) % len(data)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def perf_setup(s: Section) -> tuple[Callable[[], torch.nn.Module], list[torch.Tensor], int]:
    p = s.sizes.perf
    data = [cuda_paths.batch(i, p["micro"], s.device, p["vocab"], p["seq"] + 1) for i in range(4)]

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return cuda_paths.perf_model(p["layers"], p["width"], p["seq"], p["vocab"])

    return make, data, p["micro"]


Build = Callable[[], tuple[object, Callable[[], None]]]  # -> (an engine to destroy or None, one training step)


def timed_case(s: Section, build: Build, row: dict, first_step: bool = False) -> dict:
    """``row`` with the median step time of what ``build`` makes (``first_step``: the first step's seconds too,
    a compilation's), the peak memory, or the error; the engine is destroyed and its objects die at return."""
    engine = None
    try:
        engine, step = build()
        if first_step:
            started = time.perf_counter()
            step()
            s.sync()
            row["first_step_s"] = round(time.perf_counter() - started, 3)
        row["step_s"] = round(cuda_paths.timed_steps(step, s.sizes.steps, s.sizes.warmup, s.device), 5)
        row["peak_gib"] = s.peak_gib()
    except Exception as exc:
        row.update(error_of(exc))
    finally:
        close(engine)
    return row


def engine_build(make: Callable[[], torch.nn.Module], data: list[torch.Tensor], stage: int, micro: int,
                 **extra) -> Build:
    def build() -> tuple[object, Callable[[], None]]:
        import dsrun

        engine, _, _, _ = dsrun.initialize(model=make(), config=cuda_paths.perf_config(stage, micro, **extra))
        return engine, cuda_paths.engine_step(engine, data)

    return build


def run_vs_fsdp2(s: Section) -> None:
    make, data, micro = perf_setup(s)
    runs: list[tuple[str, Build]] = [
        ("torch", lambda: (None, cuda_paths.torch_step(make().to(s.device), data, s.device))),
        *[(f"dsrun_zero{stage}", engine_build(make, data, stage, micro)) for stage in (0, 1, 2, 3)],
        ("fsdp2", lambda: (None, fsdp2_step(make().to(s.device), data, s.device))),
    ]
    times: dict[str, float] = {}
    for name, build in runs:
        if not s.fits(name, 5.0 if s.device.type == "cuda" else 0.5):
            continue
        row = timed_case(s, build, {"case": name, **s.sizes.perf})
        s.release()
        if "step_s" in row:
            times[name] = row["step_s"]
            if "torch" in times:
                row["vs_torch"] = round(times[name] / times["torch"], 3)
        s.emit(row)
    ratio = lambda a, b: round(times[a] / times[b], 3) if a in times and b in times else None  # noqa: E731
    s.emit({"zero3_vs_fsdp2": ratio("dsrun_zero3", "fsdp2"), "zero2_vs_fsdp2": ratio("dsrun_zero2", "fsdp2"),
            "zero3_vs_zero0": ratio("dsrun_zero3", "dsrun_zero0")}, kind="summary")


def graph_breaks() -> tuple[int, int]:
    """Dynamo's graph breaks and the graphs it compiled since its counters were last cleared."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values())), int(counters["stats"]["unique_graphs"])


def run_compile(s: Section) -> None:
    import torch._dynamo

    make, data, micro = perf_setup(s)
    backend = s.sizes.compile_backend
    for stage in s.sizes.compile_stages:
        for compiled in (False, True):
            label = f"stage{stage}/{'compiled' if compiled else 'eager'}"
            if not s.fits(label, (60.0 if compiled else 5.0) if s.device.type == "cuda" else 1.0):
                continue
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            extra = {"compile": {"enabled": True, "backend": backend}} if compiled else {}
            row = timed_case(s, engine_build(make, data, stage, micro, **extra),
                             {"case": label, "stage": stage, "compiled": compiled,
                              "backend": backend if compiled else None}, first_step=True)
            row["graph_breaks"], row["graphs"] = graph_breaks()
            s.release()
            s.emit(row)


# name -> (runner, seconds it needs at least on a GPU / in --smoke, most seconds it may take on a GPU / in --smoke)
SECTIONS: dict[str, tuple[Callable[[Section], None], tuple[float, float], tuple[float, float]]] = {
    "env": (run_env, (5, 1), (60, 30)),
    "parity": (run_parity, (30, 3), (170, 25)),
    "mfu": (run_mfu, (40, 2), (100, 15)),
    "vs_fsdp2": (run_vs_fsdp2, (30, 2), (90, 15)),
    "compile": (run_compile, (60, 3), (170, 25)),
}


def section_main(name: str, smoke: bool, deadline: float, out: str) -> None:
    """A section's own process: a world of one (NCCL on CUDA, gloo with ``--smoke``), then the section."""
    sizes, device = (SMOKE, torch.device("cpu")) if smoke else (GPU, torch.device("cuda", 0))
    section = Section(sizes, device, deadline, Path(out))
    try:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"no CUDA device (torch {torch.__version__}); on a CPU run --smoke")
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = name != "parity"  # parity is exact fp32, as cuda_paths runs it
            torch.backends.cudnn.allow_tf32 = name != "parity"
        else:  # tiny models: one thread each (a loaded machine's spinning OpenMP threads cost more than they add)
            os.environ["DSRUN_ACCELERATOR"] = "cpu"
            torch.set_num_threads(1)
        import dsrun

        dsrun.init_distributed(verbose=False)
        SECTIONS[name][0](section)
    except BaseException as exc:  # the section's own failure: reported, the run goes on
        section.emit(error_of(exc), kind="error")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_section(name: str, smoke: bool, started: float, budget: float, box_scale: float = 1.0) -> dict:
    """Fork the section's process with its time box (``box_scale`` times the section's cap); its rows, status
    (ok | failed | timed_out | skipped), seconds and reason."""
    _, need, cap = SECTIONS[name]
    need_s, cap_s = need[1 if smoke else 0], cap[1 if smoke else 0] * box_scale
    left = budget - (time.monotonic() - started)
    if left < need_s:
        return {"status": "skipped", "reason": f"budget: {left:.0f} s of {budget:.0f} s left, needs ~{need_s:.0f} s",
                "rows": []}
    box = min(cap_s, left)
    with tempfile.NamedTemporaryFile(prefix=f"gpu_check_{name}_", suffix=".jsonl", delete=False) as handle:
        out = Path(handle.name)
    t0 = time.monotonic()
    proc = mp.get_context("fork").Process(target=section_main, args=(name, smoke, t0 + box, str(out)))
    proc.start()
    proc.join(box)
    timed_out = proc.is_alive()
    if timed_out:
        proc.kill()
        proc.join()
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    out.unlink()
    rows = [{k: v for k, v in line.items() if k != "kind"} for line in lines if line["kind"] == "row"]
    result = {"status": "ok", "seconds": round(time.monotonic() - t0, 1), "rows": rows}
    summary = [line for line in lines if line["kind"] == "summary"]
    if summary:
        result["summary"] = {k: v for k, v in summary[-1].items() if k != "kind"}
    errors = [line for line in lines if line["kind"] == "error"]
    if timed_out:
        result.update(status="timed_out", reason=f"killed after its time box of {box:.1f} s")
    elif errors or proc.exitcode:
        result.update(status="failed", reason=(errors[0]["error"] if errors else f"exit code {proc.exitcode}"))
        if errors:
            result["traceback"] = errors[0].get("traceback")
    elif any("error" in row for row in rows):
        result["status"] = "partial"
    return result


def fetch_wheels(folder: Path) -> int:
    """``pip download`` the wheels of dsrun's imports that the GPU image lacks, at the versions installed here,
    for the image's Python (3.12, x86-64); docs/performance.md says how a call carries them."""
    from importlib.metadata import version

    pins = [f"{name}=={version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
           "--platform", "manylinux_2_28_x86_64", "-d", str(folder), *pins]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


# --- the tables for docs/cuda.md and docs/performance.md ---------------------------------------------------------
def _fmt(value: object, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec and isinstance(value, (int, float)) else str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _outcome(row: dict) -> str:
    return row.get("error") or (f"skipped ({row['skipped']})" if "skipped" in row else "")


def tables(report: dict) -> str:
    """The report as markdown: one line per section (status, seconds, reason), then each section's table."""
    sections = report["sections"]
    out = [f"## gpu_check ({'smoke, CPU' if report['smoke'] else 'GPU'}): {report.get('elapsed_s')} s "
           f"of a {report['budget_s']:.0f} s budget",
           _table(["section", "status", "seconds", "reason"],
                  [[name, sec["status"], _fmt(sec.get("seconds")), sec.get("reason", "")]
                   for name, sec in sections.items()])]
    env = sections.get("env", {}).get("rows") or [{}]
    if env[0]:
        out.append("env: " + ", ".join(f"{k} {v}" for k, v in env[0].items()))
    rows = sections.get("parity", {}).get("rows", [])
    if rows:
        out.append(_table(["case", "max rel. loss diff", "max rel. param diff", "seconds", "error / skipped"],
                          [[r["case"], _fmt(r.get("max_rel_loss"), ".3g"), _fmt(r.get("max_rel_param"), ".3g"),
                            _fmt(r.get("seconds")), _outcome(r)] for r in rows]))
    rows = sections.get("mfu", {}).get("rows", [])
    if rows:
        out.append(_table(["case", "params", "tokens/step", "step s", "model TFLOP/s", "MFU", "engine's MFU", "peak",
                           "peak GiB", "error / skipped"],
                          [[r["case"], _fmt(r.get("params"), ",d"),
                            _fmt(r["micro"] * r["seq"] if "micro" in r else None, ",d"), _fmt(r.get("step_s")),
                            _fmt(r.get("tflops")), _fmt(r.get("mfu"), ".1%"), _fmt(r.get("engine_mfu"), ".1%"),
                            f"{_fmt(r.get('peak_tflops'))} TFLOP/s ({_fmt(r.get('peak_source'))})"
                            if "peak_tflops" in r else "-", _fmt(r.get("peak_gib")), _outcome(r)] for r in rows]))
    section = sections.get("vs_fsdp2", {})
    if section.get("rows"):
        out.append(_table(["run", "step s", "vs plain PyTorch", "peak GiB", "error / skipped"],
                          [[r["case"], _fmt(r.get("step_s")), _fmt(r.get("vs_torch")), _fmt(r.get("peak_gib")),
                            _outcome(r)] for r in section["rows"]]))
        if section.get("summary"):
            out.append("ratios (dsrun / peer): " + ", ".join(f"{k} {_fmt(v)}" for k, v in section["summary"].items()))
    rows = sections.get("compile", {}).get("rows", [])
    if rows:
        out.append(_table(["case", "first step s", "step s", "graph breaks", "graphs", "peak GiB", "error / skipped"],
                          [[r["case"], _fmt(r.get("first_step_s")), _fmt(r.get("step_s")), _fmt(r.get("graph_breaks")),
                            _fmt(r.get("graphs")), _fmt(r.get("peak_gib")), _outcome(r)] for r in rows]))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--smoke", action="store_true", help="on the CPU (gloo), tiny sizes, fp32/bf16 parity")
    parser.add_argument("--budget", type=float, help="seconds for everything (default 440 on a GPU, 55 --smoke)")
    parser.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)}")
    parser.add_argument("--box-scale", type=float, default=1.0, metavar="F",
                        help="multiply every section's time box by F (a slow or busy machine; default 1)")
    parser.add_argument("--fetch-wheels", type=Path, metavar="DIR", help="download the wheels the GPU image lacks")
    args = parser.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels)
    started = time.monotonic()
    budget = args.budget or (55.0 if args.smoke else 440.0)
    chosen = {"env", *args.only.split(",")} if args.only else set(SECTIONS)  # env is every run's preflight
    if args.box_scale <= 0:
        parser.error(f"--box-scale must be > 0, got {args.box_scale}")
    unknown = chosen - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {list(SECTIONS)}")
    try:  # imported here once, so that every forked section starts with them loaded (torch's optimizers load dynamo)
        importlib.import_module("torch._dynamo")
        importlib.import_module("dsrun.engine")
    except Exception as exc:
        print(f"[gpu_check] dsrun does not import: {type(exc).__name__}: {exc} (see docs/performance.md)", flush=True)
    report: dict = {"schema": SCHEMA, "smoke": args.smoke, "budget_s": budget, "sections": {}}
    for name in SECTIONS:
        if name not in chosen:
            report["sections"][name] = {"status": "skipped", "reason": "not in --only", "rows": []}
            continue
        print(f"[gpu_check] section {name} ({budget - (time.monotonic() - started):.0f} s left)", flush=True)
        env = report["sections"].get("env")
        if env is not None and env["status"] != "ok":  # no device, or dsrun does not import: nothing else can run
            report["sections"][name] = {"status": "skipped", "reason": f"env {env['status']}: {env.get('reason')}",
                                        "rows": []}
            continue
        report["sections"][name] = run_section(name, args.smoke, started, budget, args.box_scale)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print(tables(report), flush=True)
    return 0 if report["sections"]["env"]["status"] == "ok" else 1  # a failed section is a row of the report


if __name__ == "__main__":
    sys.exit(main())
