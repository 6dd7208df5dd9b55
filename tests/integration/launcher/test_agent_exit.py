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
        with open(f"/proc/self/task/{task}/comm") as handle:
            names.append(handle.read().strip())
    with open(os.path.join(os.environ["THREADS_AT_EXIT_DIR"], f"agent-{os.getpid()}.txt"), "w") as handle:
        handle.write("\\n".join(names))

atexit.register(_threads_at_exit)  # the first exit hook registered runs last
"""
TWO_NODES = {"127.0.0.1": [0], "localhost": [0]}  # two "nodes" on this machine, one rank each


def _start_agent(tmp_path: Path, tag: str, node_rank: int, port: int, flags: list[str]) -> subprocess.Popen:
    reports = tmp_path / "threads"
    reports.mkdir(exist_ok=True)
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(THREADS_AT_EXIT)
    script = tmp_path / "rank.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    env = job_env(tag, tmp_path, THREADS_AT_EXIT_DIR=str(reports))
    env["PYTHONPATH"] = os.pathsep.join([str(shim), env["PYTHONPATH"]])
    # --watch_stdin as under the ssh runner: stdin is a pipe the test holds open until the agent has exited
    argv = [sys.executable, "-m", "dsrun.launcher.agent", f"--world_info={encode_world_info(TWO_NODES)}",
            f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}", "--job_id=exit",
            "--no_local_rank", "--watch_stdin", *flags, str(script)]
    with open(tmp_path / f"agent-{port}-{node_rank}.log", "w") as log:
        agent = subprocess.Popen(argv, env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=log, stderr=log)
    agent.log = Path(log.name)
    return agent


def _finish(agent: subprocess.Popen) -> tuple[int, str]:
    """Wait for the agent with its stdin still open (closing it would stop the agent)."""
    try:
        agent.wait(timeout=90)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()
    agent.stdin.close()
    return agent.returncode, agent.log.read_text()


def _threads_at_exit(tmp_path: Path, agent: subprocess.Popen) -> list[str]:
    return (tmp_path / "threads" / f"agent-{agent.pid}.txt").read_text().splitlines()


def test_agents_end_every_thread_before_the_interpreter_finalizes(tmp_path):
    """A static job and an elastic one, two nodes each, run side by side: node 0 hosts the store (and in the
    elastic job, the rendezvous whose keep-alive thread every agent runs); each agent also watches stdin."""
    tag = new_tag()
    jobs = {"static": [], "elastic": ["--elastic_training", "--rdzv_last_call_timeout=1"]}
    try:
        agents = {}
        for name, flags in jobs.items():
            port = free_port()
            agents[name] = [_start_agent(tmp_path, tag, node, port, flags) for node in (0, 1)]
        for name, pair in agents.items():
            for node, agent in enumerate(pair):
                code, stderr = _finish(agent)
                assert code == 0 and "terminate called" not in stderr, f"{name} node {node}: {code}\n{stderr}"
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
