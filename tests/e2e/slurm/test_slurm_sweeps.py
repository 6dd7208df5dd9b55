"""``dsrun train -m hydra/launcher=submitit_slurm|submitit_local`` (docs/cluster.md, "Slurm"), against a real
one-node Slurm (slurmctld + slurmd + munged of this machine, tests/e2e/slurm/cluster.py) and submitit's local
executor: a 2-job sweep of 2-rank jobs goes to Slurm as one array, each job's 2 ranks 2 ``srun`` tasks of dsrun
train (the outer-launcher contract), and trains the same losses as dsrun's own ranks train the same two jobs (the
worker's per-rank entry, computed once in this module: ``run_ranks``). A job stopped by the notice (SIGUSR1, as
``--signal`` sends it) saves, is requeued and resumes. submitit's local executor runs both jobs of a sweep, each
starting its ranks with dsrun's own launcher. With no Slurm to reach, one line and exit code 2.
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.e2e.slurm.cluster import SLURM_GROUP, write_conf
from tests.helpers import REPO, require_programs, run_cli, run_ranks

# every test of the real Slurm (tests/e2e/slurm/conftest.py's session cluster) on one xdist worker, so one slurmctld
# serves them all: tests/conftest.py leaves a test that names its group in it
pytestmark = pytest.mark.xdist_group(SLURM_GROUP)

TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000",
        "ds.train_micro_batch_size_per_gpu=2", "train.eval_iters=1", "train.eval_interval=0",
        "scheduler.params.warmup_num_steps=2", "ds.steps_per_print=1"]
STEPS = 100  # long enough (seconds) for the notice to land in the middle of job 0
STAGES = ("stage1", "stage2")
SWEEP = ["launcher.num_procs=2", f"zero={','.join(STAGES)}", f"train.max_steps={STEPS}", *TINY]
# submitit's local executor: both jobs run, one rank each, a few steps (own_losses is what the Slurm jobs match)
LOCAL_STEPS = 3
LOCAL_SWEEP = ["launcher.num_procs=1", f"zero={','.join(STAGES)}", f"train.max_steps={LOCAL_STEPS}", *TINY]
TIMEOUT = 400


def losses(run_dir: Path) -> list[tuple[int, float]]:
    with open(run_dir / "dsrun" / "Train_Samples_train_loss.csv") as handle:
        return [(int(row["step"]), float(row["train_loss"])) for row in csv.DictReader(handle)]


def job_dirs(folder: Path) -> list[Path]:
    (sweep_dir,) = (folder / "multirun").glob("*/*")
    return sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def said(out: str, err: str, folder: Path) -> str:
    """The sweep's output and its jobs' own logs (submitit's), for a failed assertion."""
    logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(folder.rglob("*_log.*")))
    return f"{out[-3000:]}\n{err[-3000:]}\n{logs}"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


@dataclass
class Sweep:
    code: int
    out: str
    err: str
    folder: Path
    seconds: float
    own: dict[str, list[tuple[int, float]]] | None = None  # the Slurm sweep's: each job's losses by dsrun's own ranks

    def explain(self) -> str:
        return said(self.out, self.err, self.folder)


@dataclass
class Started:
    """A ``dsrun train -m`` started in the background, its output in files (a pipe nobody reads could fill)."""

    process: subprocess.Popen
    folder: Path
    started: float

    @classmethod
    def start(cls, folder: Path, sweep: list[str], env: dict[str, str]) -> Started:
        with open(folder / "out.txt", "w") as out, open(folder / "err.txt", "w") as err:
            process = subprocess.Popen([sys.executable, "-m", "dsrun", "train", "-m", *sweep], cwd=folder, env=env,
                                       stdout=out, stderr=err, text=True, stdin=subprocess.DEVNULL)
        return cls(process, folder, time.perf_counter())

    def said(self) -> tuple[str, str]:
        return (self.folder / "out.txt").read_text(errors="replace"), (self.folder / "err.txt").read_text(errors="replace")

    def wait(self, timeout: float) -> Sweep:
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        return Sweep(self.process.returncode, *self.said(), self.folder, time.perf_counter() - self.started)


@pytest.fixture(scope="module")
def local_started(tmp_path_factory) -> Iterator[Started]:
    """The sweep on submitit's local executor, started in the background (it runs while the Slurm sweep's jobs wait
    on Slurm and on each other): each job one process of submitit's, dsrun's own launcher starting its rank."""
    started = Started.start(tmp_path_factory.mktemp("submitit_local"), ["hydra/launcher=submitit_local", *LOCAL_SWEEP],
                            _env())
    yield started
    if started.process.poll() is None:  # its test was not run: nothing left running
        started.process.kill()
        started.process.wait()


@pytest.fixture(scope="module")
def local_sweep(local_started) -> Sweep:
    return local_started.wait(TIMEOUT)


def own_rank(rank: int, world_size: int, run_dir: Path) -> int:
    """One rank of dsrun's own launcher: the worker's per-rank entry, as dsrun's agent starts it."""
    from dsrun import worker

    return worker.main(["--run-dir", str(run_dir)])


def own_losses(tmp_path_factory) -> dict[str, list[tuple[int, float]]]:
    """Each job of the sweep (``zero=stage1``, ``zero=stage2``) trained once by two ranks of dsrun's own (the worker's
    per-rank entry, ``run_ranks``) in a run directory written as ``dsrun train`` writes it: its per-step losses."""
    from dsrun.compose import compose_runspec
    from dsrun.rundir import write_run_files
    from dsrun.runspec import resolve_run

    common = [item for item in SWEEP if not item.startswith("zero=")]
    got = {}
    for stage in STAGES:
        run_dir = tmp_path_factory.mktemp(f"own_{stage}")
        write_run_files(run_dir, resolve_run(compose_runspec([*common, f"zero={stage}"])))
        assert run_ranks(own_rank, 2, run_dir, timeout=TIMEOUT) == [0, 0]
        got[stage] = losses(run_dir)
    return got


@pytest.fixture(scope="module")
def slurm_sweep(tmp_path_factory, slurm_cluster, local_started) -> Sweep:
    """The sweep on Slurm; job 0 gets the time-limit notice (SIGUSR1 to its step, what ``--signal=USR1@S`` sends)
    once it trains: its ranks save, rank 0 requeues it, and its second run resumes. Meanwhile (the requeued job
    waits on Slurm) each job's losses by dsrun's own ranks are computed here."""
    slurm_cluster.wait_idle()
    sweep = Started.start(tmp_path_factory.mktemp("submitit_slurm"), ["hydra/launcher=submitit_slurm", *SWEEP],
                          _env(slurm_cluster.env({})))
    try:
        log = _wait_for_text(sweep, "multirun/*/*/0/logs/rank0.stdout.log", f"step 2/{STEPS}")
        (job,) = [p.name for p in (log.parents[2] / ".submitit").glob("*_0")]  # ARRAYID_0
        slurm_cluster.run("scancel", "--signal=USR1", job)  # to every process of the job's steps: the ranks
        own = own_losses(tmp_path_factory)
    except BaseException:
        sweep.process.kill()  # nothing left running; submitted jobs: the cluster's teardown cancels them
        sweep.process.wait()
        raise
    done = sweep.wait(TIMEOUT)
    done.own = own
    return done


def _wait_for_text(sweep: Started, pattern: str, text: str, timeout: float = 300) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in sweep.folder.glob(pattern):
            if text in path.read_text(errors="replace"):
                return path
        if sweep.process.poll() is not None:
            raise AssertionError(f"the sweep ended (exit {sweep.process.returncode}) before {text!r} appeared in "
                                 f"{pattern}: " + said(*sweep.said(), sweep.folder))
        time.sleep(0.2)
    raise AssertionError(f"{text!r} did not appear in {pattern} within {timeout} s")


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_a_slurm_sweep_is_one_array_of_srun_ranks_that_train_the_own_launchers_losses(slurm_sweep):
    sys.stdout.write(f"the submitit_slurm sweep, one job requeued: {slurm_sweep.seconds:.1f} s\n")
    assert slurm_sweep.code == 0, slurm_sweep.explain()
    runs = job_dirs(slurm_sweep.folder)
    assert [p.name for p in runs] == ["0", "1"]
    assert "sweep of 2 job(s): 2 finished, 0 failed" in slurm_sweep.out, slurm_sweep.explain()
    # one sbatch: an array of two tasks (submitit names their folders ARRAYID_TASK), each asking one task per rank,
    # SIGUSR1 as the notice before the time limit, requeueable
    submitted = sorted(p.name for p in (runs[0].parent / ".submitit").iterdir() if p.is_dir() and "_" in p.name)
    assert len({name.split("_")[0] for name in submitted}) == 1, submitted
    assert sorted(name.split("_")[1] for name in submitted) == ["0", "1"], submitted
    (script,) = (runs[0].parent / ".submitit").glob("*/*_submission.sh")  # the array's one batch script
    text = script.read_text()
    for line in ("#SBATCH --array=0-1%2", "#SBATCH --ntasks-per-node=2", "#SBATCH --signal=USR1@150",
                 "#SBATCH --requeue", "export SUBMITIT_PREEMPT_SIGNAL=USR1"):
        assert line in text, text
    # every job: two srun tasks were its two ranks (each rank's log, one run directory), and trained the same
    # losses, step by step, as two ranks of dsrun's own train the same job; job 0 across its requeue
    for run, stage in zip(runs, STAGES):
        local = slurm_sweep.own[stage]
        assert sorted(p.name for p in (run / "logs").glob("rank*.stdout.log")) == ["rank0.stdout.log",
                                                                                   "rank1.stdout.log"]
        assert "training as rank 0 of srun: SLURM_STEP_NUM_TASKS=2" in (run / "dsrun.log").read_text()
        assert len(losses(run)) == STEPS and losses(run) == local, run
        metrics = json.loads((run / "metrics.json").read_text())  # the last run's: job 0's went on from its checkpoint
        assert metrics.get("resumed_from_step", 0) + metrics["steps"] == STEPS


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_the_notice_saves_requeues_and_the_requeued_job_resumes(slurm_sweep):
    """Job 0 of the sweep got SIGUSR1 while it trained: both ranks stopped at a step boundary and saved there, rank
    0 requeued the job, and the job's second run resumed from that checkpoint in the same run directory."""
    assert slurm_sweep.code == 0, slurm_sweep.explain()
    run = job_dirs(slurm_sweep.folder)[0]
    log = (run / "dsrun.log").read_text()  # both runs of the job, one after the other
    stopped = re.search(rf"\[dsrun\] stopped by SIGUSR1 after step (\d+) of {STEPS}; checkpoint saved at step \1 in "
                        r"\S+/global_step\1\n", log)
    assert stopped, log[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < STEPS
    assert f"requeued job: resuming from {run / 'checkpoints' / f'global_step{step}'} at step {step}" in log
    # each run of the job met on a port its rank 0's store was given, in a rendezvous folder of its own
    assert sorted(p.name.rsplit("-", 1)[1] for p in (run / ".slurm_rendezvous").iterdir()) == ["run0", "run1"]
    (job_log,) = (run.parent / ".submitit").glob("*_0/*_0_0_log.out")
    # one log for both runs of the job (--open-mode=append): the first run's requeue line, then the second run
    text = job_log.read_text()
    first, _, second = text.partition("stopped (exit code 138); requeued (1 of 3): the run resumes from its checkpoint")
    assert second, text[-3000:]
    assert first.count("Starting with JobEnvironment") == 1 and second.count("Starting with JobEnvironment") == 1, text
    assert "[dsrun] requeued job: resuming from" not in (job_dirs(slurm_sweep.folder)[1] / "dsrun.log").read_text()


@pytest.mark.timeout(TIMEOUT + 60)
def test_submitit_local_runs_both_jobs(local_sweep):
    sys.stdout.write(f"the submitit_local sweep: {local_sweep.seconds:.1f} s\n")
    assert local_sweep.code == 0, local_sweep.explain()
    runs = job_dirs(local_sweep.folder)
    assert [p.name for p in runs] == ["0", "1"]
    assert [json.loads((run / "metrics.json").read_text())["steps"] for run in runs] == [LOCAL_STEPS, LOCAL_STEPS]
    assert [json.loads((run / "ds_config.json").read_text())["zero_optimization"]["stage"] for run in runs] == [1, 2]
    assert "sweep of 2 job(s): 2 finished, 0 failed" in local_sweep.out, local_sweep.explain()
    assert (runs[0].parent / "summary.txt").read_text().count(" ok\n") == 2


@pytest.mark.timeout(120)
def test_slurm_not_reachable_is_one_line_and_exit_code_2(tmp_path):
    """No controller answers (SLURM_CONF names no cluster): one line naming the problem and what to do, exit code 2,
    no sweep directory, nothing submitted or left running. (No sbatch on PATH:
    tests/unit/launcher/test_slurm_jobs.py.)"""
    require_programs("sbatch", "scontrol")
    conf = write_conf(tmp_path, cpus=1)  # a cluster whose slurmctld was never started: nothing at its port
    done = run_cli("train", "-m", "hydra/launcher=submitit_slurm", "zero=stage1,stage2", "train.max_steps=10",
                   cwd=tmp_path, env={"SLURM_CONF": str(conf)}, timeout=110)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert re.fullmatch(
        r"error: hydra/launcher=submitit_slurm: Slurm is not reachable: scontrol ping says 'Slurmctld\(primary\) at "
        rf"\S+ is DOWN' \(start slurmctld or point SLURM_CONF \(now {re.escape(str(conf))}\) at your cluster's "
        r"slurm.conf, or run the jobs on this machine with hydra/launcher=submitit_local\)", lines[0]), lines[0]
    assert not (tmp_path / "multirun").exists()


@pytest.mark.slow  # two more Slurm jobs (a minute on a busy machine): beyond the suite's budget for this file
@pytest.mark.timeout(TIMEOUT + 60)
def test_dsrun_tune_slurm_runs_every_trial_as_a_slurm_job(tmp_path, slurm_cluster):
    """``dsrun tune --slurm``: each trial's ``dsrun train`` under ``srun`` (a job of its own, every task a rank),
    measured as without Slurm."""
    slurm_cluster.wait_idle()
    started = time.perf_counter()
    done = run_cli("tune", "+recipe=gpt_tune", "launcher.num_procs=1", "train.max_steps=3",
                   "autotuning.tuner_num_trials=2", "+ds.autotuning.model_info.num_params=120576",
                   "--memory-limit", "1GiB", "--trial-timeout", "200", "--slurm", "--srun-args=--time=10",
                   cwd=tmp_path, env=slurm_cluster.env(), timeout=TIMEOUT)
    sys.stdout.write(f"dsrun tune --slurm, 2 trials: {time.perf_counter() - started:.1f} s\n")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = tmp_path / "autotuning_results"
    trials = [p for p in results.iterdir() if (p / "metrics.json").is_file()]
    assert len(trials) == 2, done.stdout[-3000:]
    for trial in trials:
        command = (trial / "cmd.txt").read_text().split()
        assert command[:5] == ["srun", f"--job-name=dsrun-tune-{trial.name}", "--nodes=1", "--ntasks-per-node=1",
                               "--kill-on-bad-exit=1"] and "--time=10" in command
        assert json.loads((trial / "metrics.json").read_text())["throughput"] > 0
        # the trial's rank was the srun task: dsrun train ran as srun's rank (no launcher of its own)
        assert "training as rank 0 of srun" in (trial / "run" / "dsrun.log").read_text()
