"""The node agent leaves no thread behind for the interpreter's finalization.

A thread still alive there (node 0's TCPStore server, torch's rendezvous keep-alive timer, the ssh runner's
stdin watch) meets the interpreter's teardown in no defined order, and a C++ one can abort the finished agent
("terminate called without an active exception"). A ``sitecustomize`` put on the agents' PYTHONPATH registers
an exit hook before anything else does, so it runs after every other one, right before finalization: it writes
the agent's threads, read from ``/proc/self/task`` (which lists C++ threads too), to a file per agent.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from dsrun.launcher.protocol import encode_world_info
from tests.helpers import free_port
from tests.integration.launcher.jobs import job_env, kill_job, new_tag

THREADS_AT_EXIT = """
import atexit, os, sys

def _threads_at_exit():
    if not sys.argv[0].endswith(os.path.join("dsrun", "launcher", "agent.py")):
        return  # a rank
    names = []
    for task in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                names.append(handle.read().strip())
        except FileNotFoundError:  # a thread already joined whose task ended after the listing: it is gone
            continue
    with open(os.path.join(os.environ["THREADS_AT_EXIT_DIR"], f"agent-{os.getpid()}.txt"), "w") as handle:
        handle.write("\\n".join(names))

atexit.register(_threads_at_exit)  # the first exit hook registered runs last
"""
TWO_NODES = {"127.0.0.1": [0], "localhost": [0]}  # two "nodes" on this machine, one rank each
RANK = "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n"


class Agent(NamedTuple):
    process: subprocess.Popen
    log: Path  # its stdout and stderr


def _start_agent(tmp_path: Path, tag: str, node_rank: int, port: int, flags: list[str], *,
                 world: dict[str, list[int]] = TWO_NODES, wrapper: str | None = None, script: str = RANK) -> Agent:
    """Start one agent, its stdin a pipe (``--watch_stdin``, as under the ssh runner); ``wrapper`` is Python
    code that runs the agent (``python -c WRAPPER ARGS``) instead of ``python -m dsrun.launcher.agent``."""
    reports = tmp_path / "threads"
    reports.mkdir(exist_ok=True)
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(THREADS_AT_EXIT)
    rank_script = tmp_path / f"rank-{port}.py"
    rank_script.write_text(script)
    env = job_env(tag, tmp_path, THREADS_AT_EXIT_DIR=str(reports), HOLDING=str(tmp_path / "holding"))
    env["PYTHONPATH"] = os.pathsep.join([str(shim), env["PYTHONPATH"]])
    program = ["-c", wrapper] if wrapper else ["-m", "dsrun.launcher.agent"]
    argv = [sys.executable, *program, f"--world_info={encode_world_info(world)}",
            f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}", "--job_id=exit",
            "--no_local_rank", "--watch_stdin", *flags, str(rank_script)]
    log = tmp_path / f"agent-{port}-{node_rank}.log"
    with open(log, "w") as output:
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=output, stderr=output)
    return Agent(process, log)


def _finish(agent: Agent) -> tuple[int, str]:
    """Wait for the agent with its stdin still open (closing it would stop the agent)."""
    try:
        agent.process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        agent.process.kill()
        agent.process.wait()
    agent.process.stdin.close()
    return agent.process.returncode, agent.log.read_text()


def _threads_at_exit(tmp_path: Path, agent: Agent) -> list[str]:
    return (tmp_path / "threads" / f"agent-{agent.process.pid}.txt").read_text().splitlines()


def test_agents_end_every_thread_before_the_interpreter_finalizes(tmp_path):
    """Three jobs of two nodes each run side by side: static, elastic, and static with a rank that fails (rank 1
    exits 3, so both agents fail with its exit code). Node 0 hosts the store (in the elastic job also the
    rendezvous, whose keep-alive thread every agent runs); each agent also watches stdin."""
    tag = new_tag()
    fail_rank_1 = "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    jobs = {"static": ([], RANK, 0), "elastic": (["--elastic_training", "--min_elastic_nodes=2"], RANK, 0),
            "failed rank": ([], fail_rank_1, 3)}
    try:
        agents = {}
        for name, (flags, script, _) in jobs.items():
            port = free_port()
            agents[name] = [_start_agent(tmp_path, tag, node, port, flags, script=script) for node in (0, 1)]
        for name, pair in agents.items():
            for node, agent in enumerate(pair):
                code, stderr = _finish(agent)
                assert code == jobs[name][2], f"{name} node {node}: {code}\n{stderr}"
                assert "terminate called" not in stderr, f"{name} node {node}:\n{stderr}"
                assert len(_threads_at_exit(tmp_path, agent)) == 1, (name, node, _threads_at_exit(tmp_path, agent))
    finally:
        kill_job(tag)


def test_an_agent_that_fails_to_start_ends_the_store_server_first(tmp_path):
    """Node 0 creates the store's server before torch refuses the rendezvous settings: the error's traceback
    must not keep that server's thread alive into finalization."""
    tag = new_tag()
    try:
        agent = _start_agent(tmp_path, tag, 0, free_port(), ["--elastic_training", "--rdzv_last_call_timeout=0"])
        code, stderr = _finish(agent)
        assert code == 1 and "last_call timeout" in stderr and "terminate called" not in stderr, stderr
        assert len(_threads_at_exit(tmp_path, agent)) == 1, _threads_at_exit(tmp_path, agent)
    finally:
        kill_job(tag)


# Runs node 0's agent (``python -c WRAPPER ARGS``) with torch's rendezvous heartbeat caught in flight: the
# keep-alive thread holds a strong reference to the rendezvous handler (and through it to the store and its
# server) while a heartbeat runs. This one holds it until its timer is stopped. An agent that only drops its
# references lets that thread free the store later, in the middle of the interpreter's finalization; the
# agent must stop (join) the heartbeats first.
HEARTBEAT_IN_FLIGHT = """
import os, runpy, sys
import dsrun.launcher.elastic_agent as elastic_agent
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

create_handler, keep_alive = elastic_agent.create_handler, DynamicRendezvousHandler._keep_alive

def create_with_frequent_heartbeats(store, backend, params):
    params.config.update(keep_alive_interval=1, keep_alive_max_attempt=1000)  # never "missed" while held
    return create_handler(store, backend, params)

def keep_alive_and_hold(self):
    keep_alive(self)
    if not os.path.exists(os.environ["HOLDING"]):
        open(os.environ["HOLDING"], "w").close()  # tells the rank it may finish
        self._keep_alive_timer._ctx.stop_event.wait(120)

elastic_agent.create_handler = create_with_frequent_heartbeats
DynamicRendezvousHandler._keep_alive = keep_alive_and_hold
sys.argv[0] = os.path.join("dsrun", "launcher", "agent.py")  # as ``python -m`` sets it (the exit hook reads it)
runpy.run_module("dsrun.launcher.agent", run_name="__main__")
"""
WAIT_FOR_HOLD = """
import os, time
deadline = time.monotonic() + 60
while not os.path.exists(os.environ["HOLDING"]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_a_heartbeat_in_flight_at_the_end_does_not_carry_the_store_into_finalization(tmp_path):
    tag = new_tag()
    try:
        agent = _start_agent(tmp_path, tag, 0, free_port(), ["--elastic_training", "--rdzv_last_call_timeout=1"],
                             world={"127.0.0.1": [0]}, wrapper=HEARTBEAT_IN_FLIGHT, script=WAIT_FOR_HOLD)
        code, stderr = _finish(agent)
        assert code == 0 and "terminate called" not in stderr, stderr
        assert (tmp_path / "holding").exists()  # a heartbeat was in flight while the agent finished
        assert len(_threads_at_exit(tmp_path, agent)) == 1, _threads_at_exit(tmp_path, agent)
    finally:
        kill_job(tag)
