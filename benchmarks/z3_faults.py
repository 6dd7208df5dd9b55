"""dsrun's ZeRO-3 against PyTorch's FSDP2 on the CPU: CPU time, system time, page faults and peak RSS per step.

On the CPU a ZeRO-3 step's gap to FSDP2 was page faults (system time): fresh pages the kernel faults in and
zeroes for every big temporary. Faults and peak RSS are counted by the kernel and hold under load; CPU and wall
times do not. Two gloo ranks x 1 thread, the GPT of engine_step.py, torch's AdamW, fp32, ``--steps`` steps
timed after 3 warm-up ones, each framework in fresh rank processes. Prints the worse rank's figures and the
dsrun/FSDP2 ratios; ``step_peak_rss_mib`` is the peak RSS of the timed steps alone (VmHWM reset after the
warm-up), ``peak_rss_mib`` the process's whole life (building the model whole included).

    PYTHONPATH=$PWD python benchmarks/z3_faults.py [--models gpt100m lm4x384] [--steps 5]
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_step import build_gpt  # noqa: E402

from dsrun.estimate.measure import peak_rss_bytes, reset_peak_rss  # noqa: E402

MODELS = {"gpt100m": dict(layers=12, width=832, heads=8, vocab=256, seq=17, micro=4),
          "lm4x384": dict(layers=4, width=384, heads=6, vocab=4096, seq=128, micro=4)}
WARMUP = 3


class peak_rss:  # noqa: N801 (a namespace)
    """VmHWM since :meth:`reset` (Linux)."""

    reset = staticmethod(reset_peak_rss)
    peak = staticmethod(peak_rss_bytes)


def _dsrun_step(model: torch.nn.Module, opts: dict):
    import dsrun

    config = {"train_micro_batch_size_per_gpu": opts["micro"], "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine = dsrun.initialize(model=model, config=config)[0]

    def step(tokens: torch.Tensor) -> float:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


def _fsdp2_step(model: torch.nn.Module, opts: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor) -> float:
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _rank(rank: int, framework: str, model_name: str, steps: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    opts = MODELS[model_name]
    model = build_gpt(opts["vocab"], opts["seq"], opts["width"], opts["layers"], opts["heads"])
    step = (_dsrun_step if framework == "dsrun" else _fsdp2_step)(model, opts)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, opts["vocab"], (opts["micro"], opts["seq"]), generator=g)
               for _ in range(WARMUP + steps)]
    for tokens in batches[:WARMUP]:
        step(tokens)
    peak_rss.reset()  # the training steps' own peak, apart from the model's build (a full copy before sharding)
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for tokens in batches[WARMUP:]:
        loss = step(tokens)
    w1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    results.put({"rank": rank, "wall_ms": (w1 - w0) / steps * 1e3,
                 "cpu_ms": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / steps * 1e3,
                 "sys_ms": (r1.ru_stime - r0.ru_stime) / steps * 1e3,
                 "faults": (r1.ru_minflt - r0.ru_minflt) / steps, "step_peak_rss_mib": peak_rss.peak() / 2**20,
                 "peak_rss_mib": r1.ru_maxrss / 1024, "loss": loss})


def measure(framework: str, model_name: str, steps: int) -> dict:
    """The two ranks' figures, worst rank each (a step waits for the slower rank)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_rank, args=(framework, model_name, steps, port, results), nprocs=2, start_method="spawn")
    ranks = [results.get(timeout=10) for _ in range(2)]
    return {key: max(r[key] for r in ranks) for key in ranks[0] if key != "rank"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    keys = ("wall_ms", "cpu_ms", "sys_ms", "faults", "step_peak_rss_mib", "peak_rss_mib")
    for name in args.models:
        got = {fw: measure(fw, name, args.steps) for fw in ("dsrun", "fsdp2")}
        for fw, r in got.items():
            print(f"{name:<8} {fw:<6} " + "  ".join(f"{k} {r[k]:.0f}" for k in keys), flush=True)
        print(f"{name:<8} dsrun/fsdp2 " + "  ".join(f"{k} {got['dsrun'][k] / got['fsdp2'][k]:.2f}x" for k in keys),
              flush=True)


if __name__ == "__main__":
    main()
