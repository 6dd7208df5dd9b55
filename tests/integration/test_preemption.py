"""Preemption (docs/cluster.md): SIGTERM or SIGUSR1 stops every rank at a step boundary with a checkpoint there, even
with train.save_interval=0, and the ranks exit with 138; the same command again (train.resume=auto) continues
exactly. A 2-rank run preempted at 5 seeded random steps (the signal on both ranks, as dsrun's agent passes the
launcher's on, and once on one rank only), each time started again, ends with the weights of an uninterrupted
run, bit for bit.

Each launch is the worker's per-rank entry (``dsrun.worker.main``, what dsrun's agent and a torchrun rank run) in
two fresh ranks (``run_ranks``: about 0.3 s to start, where ``dsrun train`` costs seconds of imports per launch);
each run directory is written as ``dsrun train`` writes it, and ``train.resume=auto`` is resolved by the CLI's own
``settle_auto`` over the earlier run directories. The signal is a real one, sent by the rank to itself once the
chosen step has begun (a test hook on ``RunBook.step_begins``); the weights are taken where training ends.
tests/e2e/test_preemption_cli.py sends it to the ``dsrun train`` launcher itself.
"""
from __future__ import annotations

import functools
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from dsrun.checkpoint import read_latest
from dsrun.launcher.protocol import EXIT_PREEMPTED
from tests.helpers import run_ranks

if TYPE_CHECKING:
    from dsrun.runspec import ResolvedRun

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000",
        "ds.train_micro_batch_size_per_gpu=2", "train.eval_iters=1", "train.eval_interval=0", "monitor=none",
        "scheduler.params.warmup_num_steps=2", "launcher.num_procs=2", "train.max_steps=12", "train.resume=auto"]


@functools.lru_cache(maxsize=1)
def composed() -> ResolvedRun:
    """``dsrun train TINY``'s RunSpec, composed and checked once (Hydra takes a second a time)."""
    from dsrun.compose import compose_runspec
    from dsrun.runspec import resolve_run

    return resolve_run(compose_runspec(TINY))


def open_run(outputs: Path, name: str) -> Path:
    """A run directory as ``dsrun train TINY`` writes it under ``outputs``, ``train.resume=auto`` resolved."""
    from dsrun.cli.resume import settle_auto
    from dsrun.rundir import write_provenance, write_run_files

    run_dir = outputs / "2026-12-06" / name
    run_dir.mkdir(parents=True)
    resolved, _ = settle_auto(composed(), run_dir, TINY, multirun=False)
    write_run_files(run_dir, resolved)
    write_provenance(run_dir, ["dsrun", "train", *TINY], TINY, None)
    return run_dir


def preempted_rank(rank: int, world_size: int, run_dir: Path, stop_at: int | None, signum: int,
                   signalled: tuple[int, ...]) -> tuple[int, dict[str, torch.Tensor]]:
    """The worker's entry on this rank; when ``stop_at`` is set and this rank is ``signalled``, it gets ``signum``
    once step ``stop_at`` has begun. Returns its exit code and the model's weights where training ended."""
    from dsrun import worker
    from dsrun.run_book import RunBook

    begins, finish = RunBook.step_begins, RunBook.finish
    weights: dict[str, torch.Tensor] = {}

    def step_begins(book: RunBook) -> None:
        begins(book)
        if book.last_step_done + 1 == stop_at and rank in signalled:
            os.kill(os.getpid(), signum)  # mid-step, as a scheduler's signal lands

    def finish_and_keep(book: RunBook, *args: Any, **kwargs: Any) -> dict[str, Any]:
        weights.update({name: t.detach().clone() for name, t in book.engine.module.state_dict().items()})
        return finish(book, *args, **kwargs)

    RunBook.step_begins, RunBook.finish = step_begins, finish_and_keep
    return worker.main(["--run-dir", str(run_dir)]), weights


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of the run uninterrupted (one launch, shared by the tests below)."""
    whole = open_run(tmp_path_factory.mktemp("uninterrupted"), "run")
    (code0, weights), (code1, _) = run_ranks(preempted_rank, 2, whole, None, 0, (), timeout=300)
    assert (code0, code1) == (0, 0)
    return weights


def test_a_run_preempted_five_times_ends_with_the_uninterrupted_weights(tmp_path, expected):
    started = time.perf_counter()
    rng = random.Random(38)
    outputs, at = tmp_path / "preempted" / "outputs", 0
    for attempt in range(5):
        resumed_from, at = at, rng.randint(at + 1, at + 2)
        signum = (signal.SIGTERM, signal.SIGUSR1)[attempt % 2]
        signalled = (1,) if attempt == 3 else (0, 1)  # attempt 3: one rank only; the other learns at the boundary
        run_dir = open_run(outputs, f"attempt{attempt}")
        codes = [code for code, _ in run_ranks(preempted_rank, 2, run_dir, at, signum, signalled, timeout=300)]
        assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], (attempt, codes)
        record = json.loads((run_dir / "preempted.json").read_text())
        assert record == {"signal": signum.name, "step": at, "saved": True, "checkpoint": f"global_step{at}",
                          "grace_s": 120.0, "reached_boundary": True}, attempt
        assert read_latest(run_dir / "checkpoints") == f"global_step{at}"  # saved though train.save_interval=0
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics.get("resumed_from_step", 0) == resumed_from and metrics["preempted"] == record

    last = open_run(outputs, "finish")
    (code0, final), (code1, _) = run_ranks(preempted_rank, 2, last, None, 0, (), timeout=300)
    assert (code0, code1) == (0, 0)
    assert json.loads((last / "metrics.json").read_text())["resumed_from_step"] == at
    assert not (last / "preempted.json").exists()
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
    sys.stdout.write(f"7 launches, 5 preemptions at steps up to {at}: {time.perf_counter() - started:.1f} s\n")


class EngineNotice:
    """A :class:`~dsrun.run_book.StepReporter` whose engine gives notice that it takes the machines back at the step
    boundary after step ``at`` (None: never), as Ray's node drain reaches :class:`dsrun.ray.RayReporter`; it keeps
    what it was told (the steps reported, with the checkpoint folder when one was saved)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.asked, self.reported = at, 0, []

    def notice(self) -> str | None:
        self.asked += 1
        return "test engine: node-a drained (ranks 0, 1)" if self.at is not None and self.asked >= self.at else None

    def report(self, step: int, metrics: dict[str, float], checkpoint: Path | None) -> None:
        self.reported.append((step, checkpoint.name if checkpoint is not None else None))


def noticed_rank(rank: int, world_size: int, run_dir: Path, notice_at: int | None,
                 restart_from: Path | None) -> tuple[int, int, list, dict[str, torch.Tensor]]:
    """The worker's entry as an engine runs it (``dsrun.worker.run`` with its reporter, and the checkpoint it
    restarts the group from); returns the exit code, how often the notice was asked, what was reported and the
    final weights."""
    from dsrun import worker
    from dsrun.run_book import RunBook

    finish, weights = RunBook.finish, {}

    def finish_and_keep(book: RunBook, *args: Any, **kwargs: Any) -> dict[str, Any]:
        weights.update({name: t.detach().clone() for name, t in book.engine.module.state_dict().items()})
        return finish(book, *args, **kwargs)

    RunBook.finish = finish_and_keep
    reporter = EngineNotice(notice_at)
    return worker.run(run_dir, reporter, restart_from), reporter.asked, reporter.reported, weights


def test_an_engines_preemption_notice_saves_at_that_boundary_and_the_restart_resumes_exactly(tmp_path, expected):
    """The engine's notice (what ``ray.train.get_preemption_info()`` is to dsrun.ray's reporter) is asked by every
    rank at every step boundary; once it comes the ranks stop there, save (train.save_interval=0) and report that
    checkpoint, and exit with 138; the group the engine restarts from that checkpoint ends with the uninterrupted
    weights."""
    run_dir = open_run(tmp_path / "outputs", "run")
    outcomes = run_ranks(noticed_rank, 2, run_dir, 5, None, timeout=300)
    assert [code for code, *_ in outcomes] == [EXIT_PREEMPTED, EXIT_PREEMPTED]
    assert [asked for _, asked, *_ in outcomes] == [5, 5]  # once per step boundary, on every rank
    assert [reported[-1] for _, _, reported, _ in outcomes] == [(5, "global_step5")] * 2
    record = json.loads((run_dir / "preempted.json").read_text())
    assert record == {"signal": "SIGTERM", "step": 5, "saved": True, "checkpoint": "global_step5", "grace_s": 120.0,
                      "reached_boundary": True, "notice": "test engine: node-a drained (ranks 0, 1)"}

    restarted = run_ranks(noticed_rank, 2, run_dir, None, run_dir / "checkpoints" / "global_step5", timeout=300)
    assert [code for code, *_ in restarted] == [0, 0]
    assert json.loads((run_dir / "metrics.json").read_text())["resumed_from_step"] == 5
    final = restarted[0][3]
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
