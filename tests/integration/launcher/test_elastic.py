"""Elastic training across two network-namespace hosts (1 slot each): host B is killed mid-run, the job goes
on at world size 1 with the same global batch (twice the gradient accumulation), then B joins again with the
command the launcher printed and the job finishes at world size 2.

Two ways to lose B: a crash (its processes are killed, so its connections close and A's ranks fail at once),
and a power-off (its network goes down first, so no connection closes: only the rendezvous heartbeats tell
A's agent that B is gone; the network comes back before B joins again).

Evidence comes from the run's checkpoints (one per step, all kept): each records the world size it was saved
at and the samples trained so far, so the world-size history and the global batch of every step can be read
back after the run."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port
from tests.integration.launcher.jobs import job_env, job_processes, kill_job, new_tag, wait_until_gone

pytestmark = [pytest.mark.multihost]

STEPS = 150  # enough that the job is still at world size 1 when B's launcher has started
GLOBAL_BATCH = 16
OVERRIDES = [
    "+recipe=gpt_elastic", f"train.max_steps={STEPS}", "train.save_interval=1", "train.keep_last=0",
    "train.eval_interval=0", "train.eval_iters=1", "data.max_bytes=200000", "data.seq_len=32",
    "ds.steps_per_print=1", "launcher.rdzv_last_call_timeout=2",
    # a heartbeat every 2 s: a lost node leaves the rendezvous 6 s after its last one, not torch's 15
    "launcher.rdzv_keep_alive_interval=2",
    # 16 samples per step: micro batch 4 with 2 accumulation steps on 2 ranks, 4 steps on 1
    f"ds.elasticity.max_train_batch_size={GLOBAL_BATCH}", "ds.elasticity.micro_batch_sizes=[4]",
    "ds.elasticity.max_gpus=2",
]


class Output:
    """The launcher's merged output, collected by a thread, searchable while the job runs."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self.thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.lines.append(line)

    def find(self, pattern: str) -> re.Match | None:
        for line in list(self.lines):
            match = re.search(pattern, line)
            if match:
                return match
        return None

    def text(self) -> str:
        return "".join(self.lines)


class Checkpoints:
    """step -> (world size, samples trained so far, micro-steps run so far) of every saved tag, asked while the job
    runs: a tag's file read once is remembered (until a new file of that name replaces it), so each look reads only
    the new tags, not all of up to STEPS files again every half second beside the ranks on the machine's cores."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.read: dict[str, tuple[tuple[int, int], int, tuple[int, int, int]]] = {}  # tag -> (file id, step, record)

    def __call__(self) -> dict[int, tuple[int, int, int]]:
        for tag in sorted((self.run_dir / "checkpoints").glob("global_step*")):
            files = list(tag.glob("*model_states.pt"))
            if not files:
                continue
            try:
                stat = files[0].stat()
                if self.read.get(tag.name, ((),))[0] == (stat.st_ino, stat.st_mtime_ns):
                    continue
                states = torch.load(files[0], map_location="cpu", weights_only=False)
            except Exception:  # noqa: BLE001 - a tag being written right now
                continue
            self.read[tag.name] = ((stat.st_ino, stat.st_mtime_ns), int(states["global_steps"]), (
                int(states["dp_world_size"]), int(states["global_samples"]), int(states["dsrun"]["micro_steps"])))
        return {step: record for _, step, record in self.read.values()}


def _wait(condition, timeout: float, what: str, process: subprocess.Popen, output: Output):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process.poll() is not None:
            raise AssertionError(f"the launcher exited ({process.returncode}) while waiting for {what}:\n"
                                 f"{output.text()[-6000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}:\n{output.text()[-6000:]}")


def _netns_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _link(hosts, state: str) -> None:
    subprocess.run(["ip", "-n", hosts.b.namespace, "link", "set", "dsrun0", state], check=True, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("loss", ["crash", "power-off"])
def test_elastic_train_loses_host_b_then_takes_it_back(two_hosts, tmp_path, loss):
    tag = new_tag()
    job_dir = two_hosts.job_dir(tmp_path)
    port = free_port()
    command = two_hosts.in_namespace(two_hosts.a, [
        sys.executable, "-m", "dsrun", "train", *OVERRIDES, f"launcher.hostfile={two_hosts.hostfile(slots=1)}",
        f"launcher.launcher_args=-F {two_hosts.ssh_config}", f"launcher.master_port={port}"])
    launcher = subprocess.Popen(command, env=job_env(tag, tmp_path), cwd=job_dir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    output = Output(launcher)
    joiner = None
    try:
        run_dir = Path(_wait(lambda: output.find(r"\[dsrun\] run directory (\S+)"), 120, "the run directory",
                             launcher, output).group(1))
        checkpoints = Checkpoints(run_dir)
        # two steps at world size 2, then host B dies: its agent and rank are killed
        _wait(lambda: sum(w == 2 for w, _, _ in checkpoints().values()) >= 2, 300,
              "two checkpoints at world size 2", launcher, output)
        on_b = [pid for pid in job_processes(tag) if _netns_of(pid) == two_hosts.b.netns_inode]
        assert on_b, "no process of the job runs on host B"
        if loss == "power-off":
            _link(two_hosts, "down")
        for pid in on_b:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # the job goes on alone; the launcher says how to add a node back
        join = _wait(lambda: output.find(r"A node joins with: (.+)$"), 120, "the note that B left", launcher, output)
        _wait(lambda: any(w == 1 for w, _, _ in checkpoints().values()), 300,
              "a checkpoint at world size 1", launcher, output)
        alone_after = time.monotonic() - killed_at
        if loss == "power-off":
            _link(two_hosts, "up")
        words = shlex.split(join.group(1).replace("NODE_RANK", "1"))
        assert words[:2] == ["dsrun", "launch"]
        joiner = subprocess.Popen(two_hosts.in_namespace(two_hosts.b, [sys.executable, "-m", "dsrun", *words[1:]]),
                                  env=job_env(tag, tmp_path), cwd=job_dir, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        joined = Output(joiner)
        joined_at, last_step = time.monotonic(), max(checkpoints())
        _wait(lambda: any(w == 2 and step > last_step for step, (w, _, _) in checkpoints().items()), 300,
              "a checkpoint at world size 2 after the join", launcher, output)
        print(f"{loss}: first step at world size 1 saved {alone_after:.1f} s after host B was lost; first step at world "
              f"size 2 saved {time.monotonic() - joined_at:.1f} s after B's launcher started (load average "
              f"{os.getloadavg()[0]:.1f})")
        codes = launcher.wait(timeout=400), joiner.wait(timeout=60)
        assert codes == (0, 0), f"{output.text()[-5000:]}\n--- host B's launcher:\n{joined.text()[-5000:]}"
    finally:
        _link(two_hosts, "up")
        for process in (launcher, joiner):
            if process is not None and process.poll() is None:
                process.kill()
        kill_job(tag)
    history = checkpoints()
    assert sorted(history) == list(range(1, STEPS + 1)), "every step has its checkpoint"
    worlds = [history[step][0] for step in sorted(history)]
    # world size 2, then 1 after B was lost, then 2 again once it joined
    runs = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert runs == [2, 1, 2], worlds
    print(f"{loss}: {worlds.index(1)} steps at world size 2, {worlds.count(1)} at 1, then "
          f"{len(worlds) - worlds.index(1) - worlds.count(1)} at 2")
    for step, (world, samples, micro_steps) in history.items():
        assert samples == step * GLOBAL_BATCH  # the same global batch at every step, whatever the world size
        # each step's micro-steps: 2 accumulation steps of micro batch 4 on 2 ranks, 4 on 1 (a load at another
        # world size restarts the micro-step count at the step boundary of the new accumulation, so the first
        # step after a change has no predecessor at its own world size)
        if step > 1 and history[step - 1][0] == world:
            assert micro_steps - history[step - 1][2] == GLOBAL_BATCH // (4 * world), (step, world)
        else:
            assert micro_steps == step * GLOBAL_BATCH // (4 * world), (step, world, micro_steps)
    text = output.text()
    assert "left the elastic job" in text and "world size 1" in text
    if loss == "power-off":  # no connection error reached A: its agent saw B's heartbeats stop
        assert "stopped its heartbeats" in text
    assert wait_until_gone(tag, 10) == []
