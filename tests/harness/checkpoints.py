"""The checkpoint tests' runs (tests/integration: checkpoint resume, reshard, crash, universal, offloaded and
inference checkpoints; tests/unit/checkpoint): the resumable stream of the harness's checkpoint GPT
(``StepStream``), the jobs as records (``CheckpointJob``: train, save, load, crash), the single-process
reference (``checkpoint_reference``, through ``tests.harness.runs.reference_run``) and the rank entry point
that runs a launch's jobs one after another (``run_jobs``).

Every step's global batch comes from the stream: deterministic and resumable, so a resumed run sees exactly
the batches the uninterrupted one saw (its position travels in ``client_state``). Dropout makes the loss
depend on the RNG states, so they must be restored too.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tests.harness.models import SEQ, VOCAB, checkpoint_gpt
from tests.harness.runs import checkpoint_config, full_state, reference_run


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


@dataclass(frozen=True)
class CheckpointJob:
    """One run of the checkpoint GPT (``checkpoint_gpt(dropout, frozen)``) at ZeRO ``stage`` in ``precision``
    (fp32, bf16): ``steps`` optimizer steps on the stream's batches of ``global_batch``.

    The config is ``checkpoint_config``: ``extra`` replaces whole sections, ``zero`` merges into
    ``zero_optimization`` (offload, sub-group size). ``load``: resume from that folder first (``load_tag``,
    ``load_optimizer_states``); ``save_dir``: save there after each step of ``save_at`` (under ``save_tag``);
    ``crash_at``: the last of those saves SIGKILLs ``crash_rank`` at that point of a save
    (``dsrun.checkpoint.atomic``'s crash points); ``kill_on_swap_write=(step, n)``: SIGKILL at the ``n``-th NVMe
    swap write of optimizer step ``step``; ``export16``: ``save_16bit_model`` there at the end; ``final_save``:
    save there at the end. Derive a variant with ``job.but(steps=...)``."""

    stage: int
    precision: str
    steps: int
    global_batch: int
    dropout: float = 0.1
    frozen: bool = False
    extra: dict | None = None
    zero: dict | None = None
    load: str | None = None
    load_tag: str | None = None
    load_optimizer_states: bool = True
    save_dir: str | None = None
    save_at: tuple[int, ...] = ()
    save_tag: str | None = None
    crash_at: str | None = None
    crash_rank: int = 0
    kill_on_swap_write: tuple[int, int] | None = None
    export16: str | None = None
    final_save: str | None = None

    def but(self, **changes: Any) -> CheckpointJob:
        return dataclasses.replace(self, **changes)


class _Pair(torch.nn.Module):
    """The model taking one (inputs, targets) batch, as the reference runs call it."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.model(*batch)


def checkpoint_reference(global_batch: int, steps: int, dtype: torch.dtype = torch.float32, parts: int = 1,
                         reverse: bool = False) -> dict[str, Any]:
    """Single-process PyTorch of a job (dropout 0): AdamW, the config's WarmupLR and clipping, whole global
    batches of the stream (``reference_run``; tests/tolerance.py measures its rounding spread)."""
    from dsrun.optim.lr_schedules import build_lr_scheduler

    cfg = checkpoint_config(1, "fp32", 1)

    def batch_at(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = StepStream(size, 0, 1)
        tokens.step = step
        batch = tokens.next()
        return batch[:, :-1], batch[:, 1:]

    def flat(model: torch.nn.Module) -> Any:
        return torch.cat([v.detach().double().reshape(-1) for _, v in sorted(model.model.state_dict().items())
                          if v.is_floating_point()]).numpy()

    return reference_run(
        "gpt", steps, global_batch, cfg["gradient_clipping"], dtype, parts, reverse,
        build=lambda name: _Pair(checkpoint_gpt(0.0)), batch_at=batch_at, flat=flat,
        schedule=lambda opt: build_lr_scheduler(cfg["scheduler"]["type"], opt, cfg["scheduler"]["params"]))


def flat_state(params: dict[str, Any]) -> Any:
    """A job's final parameters (``result["params"]``) as one float64 vector, in the reference's order."""
    return np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1) for _, v in sorted(params.items())
                           if np.issubdtype(np.asarray(v).dtype, np.floating)])


def run_jobs(rank: int, world: int, jobs: list[CheckpointJob]) -> list[dict[str, Any]]:
    """Rank entry point: several jobs in one launch (one process group), one after the other."""
    from dsrun import comm

    try:
        return [run_job(rank, world, job) for job in jobs]
    finally:
        if comm.is_initialized():
            comm.destroy_process_group()


def run_job(rank: int, world: int, job: CheckpointJob) -> dict[str, Any]:
    """The job on this rank: the global mean loss per step, what a load found (``load_path``, the client
    state, the loaded step and stream position), the final state (``full_state``), step count and LR."""
    import os

    import dsrun
    from dsrun import comm

    random.seed(11 + rank)
    np.random.seed(11 + rank)
    torch.manual_seed(11 + rank)  # per-rank dropout streams; re-seeded identically in every launch
    model = checkpoint_gpt(job.dropout, job.frozen)
    cfg = checkpoint_config(job.stage, job.precision, job.global_batch // world, job.extra, zero=job.zero)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if job.kill_on_swap_write:  # SIGKILL this rank in the middle of an NVMe swap (writes in flight)
        _arm_swap_kill(engine, *job.kill_on_swap_write)
    stream = StepStream(job.global_batch, rank, world)
    result: dict[str, Any] = {"losses": []}
    if job.load:
        path, client = engine.load_checkpoint(job.load, tag=job.load_tag,
                                              load_optimizer_states=job.load_optimizer_states)
        result["load_path"], result["client"] = path, {k: v for k, v in client.items() if k != "stream"}
        stream.load_state_dict(client["stream"])
        result["loaded_steps"], result["loaded_stream"] = engine.global_steps, stream.step
    for _ in range(job.steps):
        batch = stream.next()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().double().reshape(1)
        comm.all_reduce(mean)
        result["losses"].append(mean.item() / world)
        if engine.global_steps in job.save_at:
            if engine.global_steps == max(job.save_at) and job.crash_at:
                os.environ["DSRUN_TEST_CRASH_AT"] = job.crash_at  # this save SIGKILLs at that point
                os.environ["DSRUN_TEST_CRASH_RANK"] = str(job.crash_rank)
            engine.save_checkpoint(job.save_dir, tag=job.save_tag,
                                   client_state={"stream": stream.state_dict(), "note": "hi"})
    # numpy arrays travel to the parent by value (tensors would need the rank process to stay alive)
    result["params"] = {k: v.numpy() for k, v in full_state(engine).items()}
    result["global_steps"] = engine.global_steps
    result["lr"] = engine.get_lr()
    if job.export16:
        result["saved16"] = engine.save_16bit_model(job.export16)
    if job.final_save:
        engine.save_checkpoint(job.final_save, client_state={"stream": stream.state_dict()})
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
