"""Checkpoints crossing between dsrun and the real DeepSpeed: save in one, load in the other, train on.

For each ZeRO stage and precision, the same tiny GPT (tied embedding and head), config and data run three ways
on ``--world`` gloo ranks:

* uninterrupted: ``--steps + --more`` steps in each engine, with a ``save_checkpoint`` after ``--steps``;
* dsrun -> DeepSpeed: a fresh DeepSpeed engine ``load_checkpoint``s dsrun's checkpoint and trains ``--more`` steps;
* DeepSpeed -> dsrun: the same the other way.

One process per framework and phase runs every config in turn (importing DeepSpeed takes long).

The figure is the largest difference between the crossed run's losses after the load and the uninterrupted
run's losses at the same steps (of the framework that trained before the save, and of the one after). The data of
step ``s`` on rank ``r`` is the same in every run (seeded by ``(s, r)``), so a resume that restores the weights,
the Adam moments and the step counters continues the loss curve to rounding.

DeepSpeed is not a dependency of dsrun: install it in a side environment (see ``benchmarks/vs_deepspeed.py``) and
pass its interpreter::

    DSRUN_DEEPSPEED_PYTHON=/path/dsvenv/bin/python python benchmarks/cross_checkpoint.py \
        [--stages 0 1 2 3] [--precisions fp32 bf16] [--worlds 1 2] [--steps 4] [--more 4] [--parameter-alignment]

``--parameter-alignment`` sets ``zero_optimization.parameter_alignment`` in both frameworks (stages 1-2: the flat
buffers' gaps between parameters, saved as ``param_alignment_paddings``) and trains a GPT of odd sizes (width 30,
vocabulary 125), whose parameters are not all multiples of 16 bytes, so there are gaps; the table's last column is
the number of gap elements each framework laid out (the same in both: DeepSpeed's rule).

``--elastic`` sets ``zero_optimization.elastic_checkpoint`` in both (stages 1-2: DeepSpeed's elastic optimizer
layout); ``--load-world M`` loads at M ranks what ``--worlds N`` saved, with the global batch kept (``--global-batch``,
each rank training its slice of one batch per step), so the N-rank uninterrupted run is the reference. Each load
phase also loads its own framework's checkpoint (``/self`` in the JSON). DeepSpeed refuses optimizer states
saved at another data-parallel size; it then loads the weights alone (``load_optimizer_states=False``, its
elastic merge of the fp32 masters) and the refusal is reported: that row's losses after the first step follow
fresh Adam moments, so only its first loss (the loaded weights' own) is expected to match.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DS_PYTHON_ENV = "DSRUN_DEEPSPEED_PYTHON"

from engine_step import build_gpt  # noqa: E402  (benchmarks/ is the script's folder; stdlib-only import)

MODEL = {"vocab": 128, "seq": 16, "width": 32, "layers": 2, "heads": 2}
ODD_MODEL = {"vocab": 125, "seq": 15, "width": 30, "layers": 2, "heads": 2}  # --parameter-alignment: gaps


def _gaps(engine) -> int:
    """Elements of the gaps parameter_alignment left between the parameters of the engine's flat groups."""
    paddings = (getattr(engine.optimizer, "round_robin_bit16_padding", None)  # DeepSpeed's ZeRO-1/2 optimizer
                or getattr(getattr(engine, "strategy", None), "param_alignment_paddings", None) or [])  # dsrun's
    return sum(sum(group) for group in paddings)


def ds_config(stage: int, bf16: bool, aligned: bool = False, elastic: bool = False, micro: int = 2) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0,
           # torch's AdamW in both, its weight decay left out: torch's 0.01 in both (the elastic layout holds no
           # hyper-parameters: the loading run's apply, the same in both)
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
           "zero_optimization": {"stage": stage, **({"parameter_alignment": True} if aligned else {}),
                                 **({"elastic_checkpoint": True} if elastic else {})}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _name(stage: int, bf16: bool) -> str:
    return f"s{stage}_{'bf16' if bf16 else 'fp32'}"


def rank_main(rank: int, world: int, port: int, job: dict) -> None:
    """One rank of one phase, for every (stage, bf16) of ``job['configs']`` in turn: build the engine; "save":
    train ``steps`` steps, save to ``dir/<framework>_<config>``, train ``more`` steps; "load": load the other
    framework's checkpoint of that config and train ``more`` steps. Rank 0 writes the losses (or the error)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    framework = job["framework"]
    if framework == "dsrun":
        sys.path.insert(0, str(REPO))
        import dsrun as deepspeed
    else:
        import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    other = "deepspeed" if framework == "dsrun" else "dsrun"
    results = {}
    shape = ODD_MODEL if job.get("aligned") else MODEL
    batch = job.get("global_batch")  # None: 2 samples per rank, seeded by (step, rank)
    loading = job["mode"] == "load"
    sources = ([other] + ([framework] if job.get("elastic") else [])) if loading else [framework]
    for stage, bf16 in job["configs"]:
        name = _name(stage, bf16)
        for source in sources:
            key = f"{name}/self" if loading and source == framework else name
            try:
                losses, gaps, note = _train(deepspeed, rank, world, job, stage, bf16, shape, batch,
                                            os.path.join(job["dir"], f"{source}_{name}"))
                results[key], results[f"{key}/gaps"] = losses, gaps
                if note:
                    results[f"{key}/refused"] = note
            except Exception as exc:  # reported in the table; the next config still runs
                results[key] = f"{type(exc).__name__}: {exc}"[-1500:]
            dist.barrier()
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _train(deepspeed, rank: int, world: int, job: dict, stage: int, bf16: bool, shape: dict, batch: int | None,
           folder: str) -> tuple[list[float], int, str]:
    """One engine of one config: the save phase trains and saves at ``steps``, the load phase loads ``folder``
    and trains on; the losses, the gap elements and DeepSpeed's refusal of the optimizer states (if any)."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = build_gpt(**shape)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage, bf16, job.get("aligned", False), job.get("elastic", False),
                                                       batch // world if batch else 2))
    first, note = 0, ""
    if job["mode"] == "load":
        try:
            path, _ = engine.load_checkpoint(folder)
        except Exception as exc:  # DeepSpeed: optimizer states saved at another data-parallel size
            if "world size" not in str(exc):
                raise
            note = f"{type(exc).__name__}: {exc}"
            path, _ = engine.load_checkpoint(folder, load_optimizer_states=False)
        assert path is not None, "nothing loaded"
        assert engine.global_steps == job["steps"], ("global_steps after load", engine.global_steps)
        first = job["steps"]
    losses = []
    for step in range(first, job["steps"] + job["more"]):
        if job["mode"] == "save" and step == job["steps"]:
            engine.save_checkpoint(folder)
        if batch:  # one global batch per step, each rank its slice: the same data at any world size
            tokens = torch.randint(0, shape["vocab"], (batch, shape["seq"]), generator=torch.Generator().manual_seed(
                1000 * step)).chunk(world)[rank]
        else:
            gen = torch.Generator().manual_seed(1000 * step + rank)
            tokens = torch.randint(0, shape["vocab"], (2, shape["seq"]), generator=gen)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().reshape(1)
        dist.all_reduce(value)
        losses.append(float(value) / world)
    return losses, _gaps(engine), note


def worker(world: int, job: dict) -> None:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO))
    from dsrun.utils.net import free_port

    mp.start_processes(rank_main, args=(world, free_port(), job), nprocs=world, join=True, start_method="spawn")


def run_phase(python: str, world: int, job: dict, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [python, str(Path(__file__).resolve()), "--worker", str(world), json.dumps(job)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(job["out"]):
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"{job['framework']} {job['mode']} phase failed (exit {proc.returncode}):\n{tail}")
    return json.loads(Path(job["out"]).read_text())


def cross(pythons: dict, configs: list, world: int, steps: int, more: int, timeout: float,
          aligned: bool = False, elastic: bool = False, load_world: int | None = None,
          global_batch: int | None = None) -> list[dict]:
    """Both frameworks train every config and save mid-way (their uninterrupted runs), then each loads the
    other's checkpoints (at ``load_world`` ranks) and trains on."""
    with tempfile.TemporaryDirectory() as tmp:
        common = {"configs": configs, "dir": tmp, "steps": steps, "more": more, "aligned": aligned,
                  "elastic": elastic, "global_batch": global_batch}
        full, crossed = {}, {}
        for mode, store in (("save", full), ("load", crossed)):
            for fw in ("dsrun", "deepspeed"):
                ranks = world if mode == "save" else (load_world or world)
                store[fw] = run_phase(pythons[fw], ranks, {**common, "framework": fw, "mode": mode,
                                                           "out": f"{tmp}/{fw}_{mode}.json"}, timeout)
    rows = []
    for stage, bf16 in configs:
        name = _name(stage, bf16)
        row = {"world": world, "stage": stage, "precision": "bf16" if bf16 else "fp32"}
        for src, dst in (("dsrun", "deepspeed"), ("deepspeed", "dsrun")):
            after = crossed[dst][name]
            row[f"{src}->{dst}"] = after
            for ref in (src, dst):
                reference = full[ref][name]
                if isinstance(after, str) or isinstance(reference, str):
                    row[f"{src}->{dst} vs {ref}"] = after if isinstance(after, str) else reference
                else:
                    row[f"{src}->{dst} vs {ref}"] = max(abs(a - b) for a, b in zip(after, reference[steps:]))
                    row[f"{src}->{dst} vs {ref} first"] = abs(after[0] - reference[steps])  # the loaded weights'
        row["gaps"] = {fw: full[fw].get(f"{name}/gaps") for fw in full}
        for fw in crossed:  # --elastic: each framework's load of its own checkpoint, and DeepSpeed's refusals
            own = crossed[fw].get(f"{name}/self")
            if own is not None:
                row[f"{fw}->{fw} vs {fw}"] = own if isinstance(own, str) else max(
                    abs(a - b) for a, b in zip(own, full[fw][name][steps:]))
            row.setdefault("refused", {}).update({f"{fw}: {k}": v for k, v in crossed[fw].items()
                                                  if k.startswith(name + "/") and k.endswith("/refused")})
        row["full"], row["crossed"] = full, crossed
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), json.loads(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-python", default=None, help=f"interpreter with deepspeed (or ${DS_PYTHON_ENV})")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=4, help="steps before the save")
    parser.add_argument("--more", type=int, default=4, help="steps after the load")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--parameter-alignment", action="store_true", help="zero_optimization.parameter_alignment")
    parser.add_argument("--elastic", action="store_true", help="zero_optimization.elastic_checkpoint")
    parser.add_argument("--load-world", type=int, default=None, help="ranks of the load phases (default: the same)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="one global batch per step, sliced over the ranks (needed with --load-world)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    ds_python = args.deepspeed_python or os.environ.get(DS_PYTHON_ENV)
    if not ds_python:
        sys.exit(f"cross_checkpoint: pass --deepspeed-python or set {DS_PYTHON_ENV} (see the docstring)")
    pythons = {"dsrun": sys.executable, "deepspeed": ds_python}
    started, load = time.time(), os.getloadavg()[0]
    table = []
    print(f"{'world':>5} {'stage':>5} {'prec':>5}  {'dsrun->DS vs dsrun':>18} {'vs DS':>9}  "
          f"{'DS->dsrun vs DS':>15} {'vs dsrun':>9}", flush=True)
    configs = [[stage, precision == "bf16"] for precision in args.precisions for stage in args.stages]

    def cell(value: object, width: int) -> str:
        return f"{value:>{width}.2e}" if isinstance(value, float) else f"{'FAILED':>{width}}"

    for world in args.worlds:
        for row in cross(pythons, configs, world, args.steps, args.more, args.timeout, args.parameter_alignment,
                         args.elastic, args.load_world, args.global_batch):
            table.append(row)
            print(f"{world:>5} {row['stage']:>5} {row['precision']:>5}  {cell(row['dsrun->deepspeed vs dsrun'], 18)} "
                  f"{cell(row['dsrun->deepspeed vs deepspeed'], 9)}  {cell(row['deepspeed->dsrun vs deepspeed'], 15)} "
                  f"{cell(row['deepspeed->dsrun vs dsrun'], 9)}  gaps {row['gaps']}", flush=True)
            for key, value in row.items():
                if isinstance(value, str) and key not in ("precision",):
                    print(f"      {key}: {value[-600:]}", flush=True)
                elif key.endswith(" first") or key in ("dsrun->dsrun vs dsrun", "deepspeed->deepspeed vs deepspeed"):
                    print(f"      {key}: {cell(value, 9)}", flush=True)
            for key, value in row.get("refused", {}).items():
                print(f"      refused, loaded the weights alone: {key}: {value[-300:]}", flush=True)
    print(f"max |loss difference| over the {args.more} steps after the load, against the uninterrupted run of the "
          f"named framework; {args.steps} steps before the save; {time.time() - started:.0f} s, load avg "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    failed = any(isinstance(v, str) for row in table for k, v in row.items() if k != "precision")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
