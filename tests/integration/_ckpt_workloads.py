"""Per-rank training jobs for the checkpoint tests (importable by ``tests.helpers.run_ranks`` ranks).

A job is a dict: ``stage``, ``precision`` (fp32|bf16), ``steps`` (optimizer steps to run), ``global_batch``,
``save_dir`` and ``save_at`` (steps after which to save), ``load`` (a dir to resume from first), ``dropout``.
Every step's global batch comes from the data loader below: a deterministic, resumable stream, so a resumed run
sees exactly the batches the uninterrupted one saw (its position travels in ``client_state``). Dropout makes
the loss depend on the RNG states, so they must be restored too.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.harness.models import SEQ, VOCAB, checkpoint_gpt
from tests.harness.runs import checkpoint_config



class StepStream:
    """The global batch of step k is fixed by (seed, k); each rank takes its contiguous slice."""

    def __init__(self, global_batch: int, rank: int, world: int, seed: int = 7):
        self.global_batch, self.rank, self.world, self.seed = global_batch, rank, world, seed
        self.step = 0

    def next(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.step)
        tokens = torch.randint(0, VOCAB, (self.global_batch, SEQ + 1), generator=gen)
        self.step += 1
        per = self.global_batch // self.world
        return tokens[self.rank * per:(self.rank + 1) * per]

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = sd["step"]


class _Pair(torch.nn.Module):
    """The model taking one (inputs, targets) batch, as the reference runs call it."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.model(*batch)


def job_reference(global_batch: int, steps: int, dtype: torch.dtype = torch.float32, parts: int = 1,
                  reverse: bool = False) -> dict[str, Any]:
    """Single-process PyTorch of a job (dropout 0): AdamW, the config's WarmupLR and clipping, whole global
    batches (tests/harness/runs.reference_run; tests/tolerance.py measures its rounding spread)."""
    from dsrun.optim.lr_schedules import build_lr_scheduler
    from tests.harness.runs import reference_run as harness_reference

    cfg = checkpoint_config(1, "fp32", 1)

    def batch_at(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = StepStream(size, 0, 1)
        tokens.step = step
        batch = tokens.next()
        return batch[:, :-1], batch[:, 1:]

    def flat(model: torch.nn.Module) -> Any:
        return torch.cat([v.detach().double().reshape(-1) for _, v in sorted(model.model.state_dict().items())
                          if v.is_floating_point()]).numpy()

    return harness_reference(
        "gpt", steps, global_batch, cfg["gradient_clipping"], dtype, parts, reverse,
        build=lambda name: _Pair(checkpoint_gpt(0.0)), batch_at=batch_at, flat=flat,
        schedule=lambda opt: build_lr_scheduler(cfg["scheduler"]["type"], opt, cfg["scheduler"]["params"]))


def flat_state(params: dict[str, Any]) -> Any:
    """A job's final parameters (``result["params"]``) as one float64 vector, in the reference's order."""
    return np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1) for _, v in sorted(params.items())
                           if np.issubdtype(np.asarray(v).dtype, np.floating)])


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """The live model's full fp32 state (gathered under stage 3)."""
    if engine.zero_optimization_stage() == 3:
        from dsrun.zero.stage3 import full_state_dict

        return {k: v.float().clone() for k, v in full_state_dict(engine.module).items()}
    return {k: v.detach().float().cpu().clone() for k, v in engine.module.state_dict().items()}


def run_jobs(rank: int, world: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several jobs in one launch (one process group), one after the other."""
    from dsrun import comm

    try:
        return [run_job(rank, world, job) for job in jobs]
    finally:
        if comm.is_initialized():
            comm.destroy_process_group()


def run_job(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    import os

    import dsrun
    from dsrun import comm

    random.seed(11 + rank)
    np.random.seed(11 + rank)
    torch.manual_seed(11 + rank)  # per-rank dropout streams; re-seeded identically in every launch
    model = checkpoint_gpt(job.get("dropout", 0.1), job.get("frozen", False))
    micro = job["global_batch"] // world
    cfg = checkpoint_config(job["stage"], job["precision"], micro, job.get("extra"))
    cfg["zero_optimization"].update(job.get("zero", {}))  # e.g. offload_optimizer, sub_group_size
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if job.get("kill_on_swap_write"):  # SIGKILL this rank in the middle of an NVMe swap (writes in flight)
        _arm_swap_kill(engine, *job["kill_on_swap_write"])
    stream = StepStream(job["global_batch"], rank, world)
    result: dict[str, Any] = {"losses": []}
    if job.get("load"):
        path, client = engine.load_checkpoint(job["load"], tag=job.get("load_tag"),
                                              load_optimizer_states=job.get("load_optimizer_states", True))
        result["load_path"], result["client"] = path, {k: v for k, v in client.items() if k != "stream"}
        stream.load_state_dict(client["stream"])
        result["loaded_steps"], result["loaded_stream"] = engine.global_steps, stream.step
    for _ in range(job["steps"]):
        batch = stream.next()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().double().reshape(1)
        comm.all_reduce(mean)
        result["losses"].append(mean.item() / world)
        if engine.global_steps in job.get("save_at", ()):
            if engine.global_steps == max(job["save_at"]) and job.get("crash_at"):
                os.environ["DSRUN_TEST_CRASH_AT"] = job["crash_at"]  # this save SIGKILLs at that point
                os.environ["DSRUN_TEST_CRASH_RANK"] = str(job.get("crash_rank", 0))
            engine.save_checkpoint(job["save_dir"], tag=job.get("save_tag"),
                                   client_state={"stream": stream.state_dict(), "note": "hi"})
    # numpy arrays travel to the parent by value (tensors would need the rank process to stay alive)
    result["params"] = {k: v.numpy() for k, v in full_params(engine).items()}
    result["global_steps"] = engine.global_steps
    result["lr"] = engine.get_lr()
    if job.get("export16"):
        result["saved16"] = engine.save_16bit_model(job["export16"])
    if job.get("final_save"):
        engine.save_checkpoint(job["final_save"], client_state={"stream": stream.state_dict()})
    comm.barrier()
    return result


def _arm_swap_kill(engine: Any, step: int, writes: int) -> None:
    """SIGKILL the process at the ``writes``-th swap write of optimizer step ``step`` (1-based), right after
    issuing it, so the swap files are mid-update when the process dies."""
    import os
    import signal

    store = engine.strategy.placement.offloaded.swapped.store
    real_write, count = store.async_write, {"n": 0}

    def write(key: str, tensor: torch.Tensor) -> None:
        real_write(key, tensor)
        if engine.global_steps + 1 == step and not key.startswith("grad."):
            count["n"] += 1
            if count["n"] == writes:
                os.kill(os.getpid(), signal.SIGKILL)

    store.async_write = write


def save_failures(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each rank passes its own tag: Fail raises on every rank; Warn saves once, under rank 0's tag. Then a
    write fails on rank 1 only (a full disk): every rank raises the same one line instead of hanging, nothing is
    committed."""
    import dsrun
    from dsrun import comm
    from dsrun.checkpoint import CheckpointTagError, atomic

    out: dict[str, Any] = {}
    for mode in ("Fail", "Warn"):
        model = checkpoint_gpt(0.0)
        cfg = checkpoint_config(1, "fp32", 2, {"checkpoint": {"tag_validation": mode}})
        engine, *_ = dsrun.initialize(model=model, config=cfg)
        try:
            engine.save_checkpoint(f"{root}/{mode}", tag=f"mine{rank}")
            out[mode] = "saved"
        except AssertionError as exc:  # what DeepSpeed raises there; dsrun's CheckpointTagError is one
            assert isinstance(exc, CheckpointTagError)
            out[mode] = str(exc)
    real_save = atomic.save_torch

    def full_disk(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        if atomic._counting:  # counting what the save needs writes nothing: let it count
            return real_save(obj, path, *args, **kwargs)
        raise OSError(28, "No space left on device")

    if rank == 1:
        atomic.save_torch = full_disk
    try:
        engine.save_checkpoint(f"{root}/Warn", tag="broken")
        out["disk"] = "saved"
    except Exception as exc:
        out["disk"] = f"{type(exc).__name__}: {exc}"
    finally:
        atomic.save_torch = real_save
    comm.destroy_process_group()
    return out


def save_own_tags(rank: int, world: int, root: str) -> list[str]:
    """DeepSpeed's TestCheckpointUniqueTag with tag_validation Ignore: each rank saves under its own tag."""
    import dsrun

    engine, *_ = dsrun.initialize(model=checkpoint_gpt(0.0, False),
                                  config=checkpoint_config(1, "fp32", 2, {"checkpoint": {"tag_validation": "Ignore"}}))
    engine.save_checkpoint(root, tag=f"tag-{rank}")
    return sorted(p.name for p in (Path(root) / f"tag-{rank}").iterdir())
