"""dsrun's ZeRO-3 against PyTorch's FSDP2 on the CPU: CPU time, system time, page faults and peak RSS per step.

On the CPU a ZeRO-3 step's gap to FSDP2 was page faults (system time): fresh pages the kernel faults in and
zeroes for every big temporary. Faults and peak RSS are counted by the kernel and hold under load; CPU and wall
times do not. Two gloo ranks x 1 thread, the GPT of engine_step.py, torch's AdamW, fp32, ``--steps`` steps
timed after 3 warm-up ones, each framework in fresh rank processes. Prints the worse rank's figures and the
dsrun/FSDP2 ratios; ``step_peak_rss_mib`` is the peak RSS of the timed steps alone (VmHWM reset after the
warm-up), ``peak_rss_mib`` the process's whole life (building the model whole included). A second line per
framework splits each step's faults and peak RSS into its forward, backward and optimizer step.

    PYTHONPATH=$PWD python benchmarks/z3_faults.py [--models gpt100m lm4x384] [--steps 5] [--frameworks dsrun fsdp2]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_step import build_gpt  # noqa: E402
from ranks import rank_env, run_ranks  # noqa: E402

from dsrun.estimate.measure import peak_rss_bytes, reset_peak_rss  # noqa: E402

MODELS = {"gpt100m": dict(layers=12, width=832, heads=8, vocab=256, seq=17, micro=4),
          "lm4x384": dict(layers=4, width=384, heads=6, vocab=4096, seq=128, micro=4)}
WARMUP = 3


PHASES = ("forward", "backward", "step")


class PhaseMeter:
    """Minor page faults and peak RSS (VmHWM, reset at each phase's start) per phase of the step, summed over
    the timed steps."""

    def __init__(self) -> None:
        self.faults = {phase: 0 for phase in PHASES}
        self.peak = {phase: 0 for phase in PHASES}
        self._last = 0

    def start(self) -> None:
        reset_peak_rss()
        self._last = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def end(self, phase: str) -> None:
        now = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.faults[phase] += now - self._last
        self.peak[phase] = max(self.peak[phase], peak_rss_bytes())
        reset_peak_rss()
        self._last = resource.getrusage(resource.RUSAGE_SELF).ru_minflt


Step = Callable[[torch.Tensor, Callable[[str], None]], float]


def _dsrun_step(model: torch.nn.Module, opts: dict) -> Step:
    import dsrun

    config = {"train_micro_batch_size_per_gpu": opts["micro"], "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine = dsrun.initialize(model=model, config=config)[0]

    def step(tokens: torch.Tensor, phase_done: Callable[[str], None]) -> float:
        loss = engine(tokens)
        phase_done("forward")
        engine.backward(loss)
        phase_done("backward")
        engine.step()
        phase_done("step")
        return loss.item()
    return step


def _fsdp2_step(model: torch.nn.Module, opts: dict) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor, phase_done: Callable[[str], None]) -> float:
        loss = model(tokens)
        phase_done("forward")
        loss.backward()
        phase_done("backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phase_done("step")
        return loss.item()
    return step


def _rank(rank: int, world: int, port: int, results, framework: str, model_name: str, steps: int) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    opts = MODELS[model_name]
    model = build_gpt(opts["vocab"], opts["seq"], opts["width"], opts["layers"], opts["heads"])
    step = (_dsrun_step if framework == "dsrun" else _fsdp2_step)(model, opts)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, opts["vocab"], (opts["micro"], opts["seq"]), generator=g)
               for _ in range(WARMUP + steps)]
    for tokens in batches[:WARMUP]:
        step(tokens, lambda phase: None)
    life_peak = peak_rss_bytes()  # the build (a full copy of the model before sharding) and the warm-up
    meter = PhaseMeter()  # the training steps' own peak
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for tokens in batches[WARMUP:]:
        meter.start()
        loss = step(tokens, meter.end)
    w1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    results.put({"rank": rank, "wall_ms": (w1 - w0) / steps * 1e3,
                 "cpu_ms": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / steps * 1e3,
                 "sys_ms": (r1.ru_stime - r0.ru_stime) / steps * 1e3,
                 "faults": (r1.ru_minflt - r0.ru_minflt) / steps,
                 "step_peak_rss_mib": max(meter.peak.values()) / 2**20,
                 **{f"{phase}_faults": meter.faults[phase] / steps for phase in PHASES},
                 **{f"{phase}_peak_mib": meter.peak[phase] / 2**20 for phase in PHASES},
                 "peak_rss_mib": max(life_peak, *meter.peak.values()) / 2**20, "loss": loss})


def measure(framework: str, model_name: str, steps: int) -> dict:
    """The two ranks' figures, worst rank each (a step waits for the slower rank)."""
    ranks = run_ranks(_rank, 2, framework, model_name, steps, timeout=3600)
    return {key: max(r[key] for r in ranks) for key in ranks[0] if key != "rank"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--frameworks", nargs="+", default=["dsrun", "fsdp2"], choices=["dsrun", "fsdp2"])
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    keys = ("wall_ms", "cpu_ms", "sys_ms", "faults", "step_peak_rss_mib", "peak_rss_mib")
    phase_keys = tuple(f"{phase}_{what}" for phase in PHASES for what in ("faults", "peak_mib"))
    for name in args.models:
        got = {fw: measure(fw, name, args.steps) for fw in args.frameworks}
        for fw, r in got.items():
            print(f"{name:<8} {fw:<6} " + "  ".join(f"{k} {r[k]:.0f}" for k in keys), flush=True)
            print(f"{'':<8} {'':<6} " + "  ".join(f"{k} {r[k]:.0f}" for k in phase_keys), flush=True)
        if len(got) == 2:
            print(f"{name:<8} dsrun/fsdp2 " + "  ".join(f"{k} {got['dsrun'][k] / got['fsdp2'][k]:.2f}x"
                                                       for k in keys), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
