"""Hugging Face Trainer checkpoints crossing between dsrun and the real DeepSpeed: a ``checkpoint-N`` one writes,
the other resumes (``trainer.train(resume_from_checkpoint=...)``), at ZeRO-2 and ZeRO-3 on 2 CPU ranks.

The Trainer script is the suite's (``tests/integration/_hf_data.py``: the tiny GPT-2 built from its config, the
learnable sequences, ``TrainingArguments(deepspeed=<config with "auto" values>)`` saving every 2 steps), run as a
rank of this file (``--rank``). dsrun's ranks start with ``python -m dsrun launch --as-deepspeed --num_procs 2``,
DeepSpeed's with its own launcher (``python -m deepspeed.launcher.runner --num_gpus 2``; on a machine without a
GPU DeepSpeed picks its CPU accelerator, and ``LOCAL_SIZE=2`` tells it the two slots). Per stage, six runs:

* uninterrupted: each framework trains ``--steps`` steps from scratch (its ``checkpoint-K`` is the one crossed);
* own resume: each framework resumes its own ``checkpoint-K`` and trains to ``--steps``;
* crossed: dsrun resumes DeepSpeed's ``checkpoint-K``, DeepSpeed resumes dsrun's.

Each rank records its loss of every step unrounded (the Trainer logs 4 decimals); rank 0 prints the mean over the
ranks. The figures: the largest difference between a crossed resume's losses and the writing framework's own
resume of that checkpoint (the same state, the other framework's arithmetic: the claim that the state crossed);
beside it, against the resuming framework's own resume of its own checkpoint, and the gap between the two
frameworks' uninterrupted runs at the same steps (how far apart their arithmetic drifts).

The optimizer is torch's AdamW in both (``"torch_adam": true`` added to the config's optimizer params; DeepSpeed's
fused CPU Adam would need a JIT build in the side environment). The gradients are the same sums (two ranks: a + b
in either order); what differs is the gradient norm that clipping (``"auto"``: 1.0) divides by, whose squares
dsrun sums in float64 and DeepSpeed in float32 (the Trainer's logged ``grad_norm`` 1.2445072 against 1.2445077 at
step 1), so the Adam moments the two save differ in their last bits (3e-9) and a crossed resume may differ from the
writing framework's own resume by a few float32 units in the last place of the loss (2.4e-7 each for losses in
[2, 4)). ``--tolerance`` (default 1e-6, four such units) is the verdict's bound: a piece of state lost in the
crossing (the Adam moments, the step count, the scheduler's position, the data or RNG position) changes the next
updates by up to the learning rate (1e-2) per weight, or feeds other samples, which the losses show orders of
magnitude above it. The exit status is 1 when a crossed resume exceeds it.

DeepSpeed is not a dependency of dsrun: install it in a side environment (``benchmarks/vs_deepspeed.py`` says how)
with the same torch and transformers, and pass its interpreter::

    DSRUN_DEEPSPEED_PYTHON=/path/dsvenv/bin/python python benchmarks/hf_cross_checkpoint.py \
        [--stages 2 3] [--steps 6] [--resume-at 2] [--json out.json]
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
HF_SCRIPTS = REPO / "tests" / "integration"
DS_PYTHON_ENV = "DSRUN_DEEPSPEED_PYTHON"
FRAMEWORKS = ("dsrun", "deepspeed")


def rank_main(stage: int, output_dir: str, max_steps: int, resume_from: str | None) -> None:
    """One rank of a Trainer run (started by either launcher). Rank 0 prints ``LOSSES [...]``: the mean over the
    ranks of each step's loss, unrounded, for the steps this run trained."""
    sys.path.insert(0, str(HF_SCRIPTS))
    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel, Trainer

    from _hf_data import Sequences, auto_ds_config, tiny_gpt2_config, training_arguments

    class RecordingTrainer(Trainer):
        """Keeps each step's loss as the rank computed it (one micro-batch a step: accumulation is 1)."""

        step_losses: list = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.step_losses.append(loss.detach().float().reshape(1))
            return loss

    ds_config = auto_ds_config({"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3})
    ds_config["optimizer"]["params"]["torch_adam"] = True
    args = training_arguments(output_dir, max_steps, ds_config)
    torch.manual_seed(0)
    trainer = RecordingTrainer(model=GPT2LMHeadModel(tiny_gpt2_config()), args=args, train_dataset=Sequences())
    trainer.train(resume_from_checkpoint=resume_from)
    losses = torch.cat(trainer.step_losses)
    dist.all_reduce(losses)
    if dist.get_rank() == 0:
        print("LOSSES", json.dumps((losses / dist.get_world_size()).tolist()), flush=True)


def launch(framework: str, ds_python: str, stage: int, output_dir: Path, steps: int, resume_from: Path | None,
           timeout: float) -> list[float]:
    """One 2-rank Trainer run under ``framework``'s launcher; the losses rank 0 printed."""
    rank_args = ["--rank", str(stage), str(output_dir), str(steps)] + ([str(resume_from)] if resume_from else [])
    sys.path.insert(0, str(REPO))
    from dsrun.utils.net import free_port

    flags = ["--no_local_rank", "--master_port", str(free_port()), str(Path(__file__).resolve()), *rank_args]
    if framework == "dsrun":
        cmd = [sys.executable, "-m", "dsrun", "launch", "--as-deepspeed", "--num_procs", "2", *flags]
    else:
        cmd = [ds_python, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "LOCAL_SIZE": "2"}
    proc = subprocess.run(cmd, env=env, cwd=output_dir.parent, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if "LOSSES " in line]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{framework} stage {stage} run {output_dir.name} failed (exit {proc.returncode}):\n"
                           + (proc.stdout + proc.stderr)[-4000:])
    return json.loads(lines[-1].split("LOSSES ", 1)[1])


def cross(ds_python: str, stage: int, steps: int, resume_at: int, timeout: float) -> dict:
    """The six runs of one stage (above) and their differences."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full, own, crossed = {}, {}, {}
        for fw in FRAMEWORKS:
            full[fw] = launch(fw, ds_python, stage, root / f"{fw}-full", steps, None, timeout)
        for fw in FRAMEWORKS:
            other = FRAMEWORKS[1 - FRAMEWORKS.index(fw)]
            own[fw] = launch(fw, ds_python, stage, root / f"{fw}-own", steps,
                             root / f"{fw}-full" / f"checkpoint-{resume_at}", timeout)
            crossed[fw] = launch(fw, ds_python, stage, root / f"{fw}-from-{other}", steps,
                                 root / f"{other}-full" / f"checkpoint-{resume_at}", timeout)

    def gap(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b), (a, b)
        return max(abs(x - y) for x, y in zip(a, b))

    return {"stage": stage, "full": full, "own_resume": own, "crossed_resume": crossed,
            "own_resume_vs_full": {fw: gap(own[fw], full[fw][resume_at:]) for fw in FRAMEWORKS},
            "deepspeed_to_dsrun_vs_deepspeed_own": gap(crossed["dsrun"], own["deepspeed"]),
            "dsrun_to_deepspeed_vs_dsrun_own": gap(crossed["deepspeed"], own["dsrun"]),
            "deepspeed_to_dsrun_vs_dsrun_own": gap(crossed["dsrun"], own["dsrun"]),
            "dsrun_to_deepspeed_vs_deepspeed_own": gap(crossed["deepspeed"], own["deepspeed"]),
            "dsrun_vs_deepspeed_full_after_resume_point": gap(full["dsrun"][resume_at:], full["deepspeed"][resume_at:])}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        rank_main(int(argv[1]), argv[2], int(argv[3]), argv[4] if len(argv) > 4 else None)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-python", default=None, help=f"interpreter with deepspeed (or ${DS_PYTHON_ENV})")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[2, 3])
    parser.add_argument("--steps", type=int, default=6, help="steps of every run (checkpoints every 2)")
    parser.add_argument("--resume-at", type=int, default=2, help="the checkpoint-K resumed (K even, < --steps)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--tolerance", type=float, default=1e-6, help="bound on a crossed resume's difference")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    ds_python = args.deepspeed_python or os.environ.get(DS_PYTHON_ENV)
    if not ds_python:
        sys.exit(f"hf_cross_checkpoint: pass --deepspeed-python or set {DS_PYTHON_ENV} (see the docstring)")
    if args.resume_at % 2 or not 0 < args.resume_at < args.steps:
        sys.exit("hf_cross_checkpoint: --resume-at must be even and below --steps (the Trainer saves every 2 steps)")
    started, load = time.time(), os.getloadavg()[0]
    table, within = [], True
    for stage in args.stages:
        row = cross(ds_python, stage, args.steps, args.resume_at, args.timeout)
        table.append(row)
        print(f"ZeRO-{stage}: mean loss over 2 ranks of steps {args.resume_at + 1}-{args.steps}")
        for label, losses in (("dsrun uninterrupted", row["full"]["dsrun"][args.resume_at:]),
                              ("DeepSpeed uninterrupted", row["full"]["deepspeed"][args.resume_at:]),
                              ("dsrun resumes dsrun's", row["own_resume"]["dsrun"]),
                              ("DeepSpeed resumes DeepSpeed's", row["own_resume"]["deepspeed"]),
                              ("dsrun resumes DeepSpeed's", row["crossed_resume"]["dsrun"]),
                              ("DeepSpeed resumes dsrun's", row["crossed_resume"]["deepspeed"])):
            print(f"  {label:<31}" + " ".join(f"{value:.7f}" for value in losses))
        print(f"  max |difference|: DeepSpeed->dsrun vs DeepSpeed's own resume "
              f"{row['deepspeed_to_dsrun_vs_deepspeed_own']:.2e}, dsrun->DeepSpeed vs dsrun's own resume "
              f"{row['dsrun_to_deepspeed_vs_dsrun_own']:.2e}; DeepSpeed->dsrun vs dsrun's own resume "
              f"{row['deepspeed_to_dsrun_vs_dsrun_own']:.2e}, dsrun->DeepSpeed vs DeepSpeed's own resume "
              f"{row['dsrun_to_deepspeed_vs_deepspeed_own']:.2e}; the two uninterrupted runs "
              f"{row['dsrun_vs_deepspeed_full_after_resume_point']:.2e}; own resume vs uninterrupted: dsrun "
              f"{row['own_resume_vs_full']['dsrun']:.2e}, DeepSpeed {row['own_resume_vs_full']['deepspeed']:.2e}",
              flush=True)
        worst = max(row["deepspeed_to_dsrun_vs_deepspeed_own"], row["dsrun_to_deepspeed_vs_dsrun_own"])
        within = within and worst <= args.tolerance
        print(f"  crossed resumes {'within' if worst <= args.tolerance else 'BEYOND'} {args.tolerance:.0e} of the "
              "writing framework's own resume of the same checkpoint", flush=True)
    print(f"{time.time() - started:.0f} s, load avg {load:.1f} -> {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
