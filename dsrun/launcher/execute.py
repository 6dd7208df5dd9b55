"""Running a :class:`~dsrun.launcher.plan.LaunchPlan`: start the node commands, relay their output, and
turn the agents' failure reports into one clear message and exit code.

The agents do the supervision (see :mod:`dsrun.launcher.supervision`); this side only has to make sure
nothing outlives the job: when any node command exits non-zero, or the launcher gets SIGINT/SIGTERM/SIGUSR1,
every other node is told to stop (the ssh runner closes the agent's stdin, which it watches; local agents get
the signal the launcher got, SIGTERM after a failure, and pass it on to their ranks), and whatever is still
running after a grace period is killed (40 s; ``LaunchOptions.stop_grace`` plus two ``STOP_MARGIN`` when
given: ``dsrun train``'s ``train.preemption.grace_s``). Every child is also started with
``PR_SET_PDEATHSIG`` so even a SIGKILLed launcher takes its agents (and, through them, the ranks) down.

With ``--elastic_training`` a node command that ends while others run is a node leaving: the launcher says
so (with the command that adds a node back) and lets the job go on; the job succeeded when any node's agent
finished with success (the agents of the last rendezvous round finish together).

A caller that explains the outcome itself (``dsrun train``) passes a :class:`JobOutcome`: a rank's report of a
user's mistake (:func:`~dsrun.launcher.protocol.report_user_error`), a Ctrl-C or a SIGTERM then ends the
relay of the job's stderr (what follows is ranks being stopped: torch elastic's and gloo's noise; stdout,
read on another thread, keeps what the ranks printed before); the job's summary lines are left out, and the
outcome holds the problems and the signal. A rank that exited with 138 or 143 by itself (``EXIT_PREEMPTED``:
the ranks stopped on a signal a rank got and saved a checkpoint; ``EXIT_STOPPED``: they stopped without one)
is no failure to report either: that is the exit code and the caller words it. With ``DSRUN_DEBUG=1``
everything is relayed as usual. A second Ctrl-C kills the job at once.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

from dsrun.launcher.options import STOP_MARGIN
from dsrun.launcher.protocol import (EXIT_PREEMPTED, EXIT_STOPPED, FAILURE_MARKER, STOP_SIGNALS, debug_requested,
                                     exit_code_for, parse_user_error)
from dsrun.launcher.plan import LaunchPlan
from dsrun.launcher.runners import RUNNER_TOOLS, NodeCommand, runner_environment
from dsrun.utils.errors import EXIT_USAGE, Problem, UserError

STOP_GRACE = 40.0  # seconds from "please stop" to SIGKILL (the agents give their ranks 30 s; Ctrl-C twice: now)
SSH_CHECK_TIMEOUT = 20.0
_TAIL = 10


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the launcher dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class JobOutcome:
    """How a job ended, for a caller that words it itself: ``exit_code``; ``signal`` the SIGINT/SIGTERM/SIGUSR1 that
    stopped it (None when it ended on its own); ``user_errors`` the problems a rank reported as the user's
    mistake (its exit code is then 2), each once, in the order first reported; ``failed_rank`` the rank the
    agents found failed first (the cause; the others' failures followed from it), None when none did."""

    exit_code: int = 0
    signal: int | None = None
    user_errors: list[str] = field(default_factory=list)
    failed_rank: int | None = None


@dataclass
class _Node:
    command: NodeCommand
    process: subprocess.Popen
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=_TAIL))
    threads: list[threading.Thread] = field(default_factory=list)
    left_noted: bool = False


class _Job:
    def __init__(self, plan: LaunchPlan, out: IO[str], err: IO[str], outcome: JobOutcome | None = None) -> None:
        self.plan = plan
        self.out = out
        self.err = err
        self.outcome = outcome
        self.quiet = outcome is not None and not debug_requested()  # the caller words the ending
        self.nodes: list[_Node] = []
        self.reports: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.signal_received: int | None = None
        self.signals = 0  # how many stop signals arrived: a second one kills the job at once
        grace = plan.options.stop_grace
        self.stop_grace = STOP_GRACE if grace is None else grace + 2 * STOP_MARGIN
        self.prefix = len(plan.commands) > 1 or plan.runner not in ("local", "no_ssh")

    # ---- output ----------------------------------------------------------------------------------

    def _write(self, stream: IO[str], node: _Node, line: str) -> None:
        text = f"[{node.command.label}] {line}" if self.prefix else line
        with self.lock:
            if self.quiet and stream is self.err and (self.outcome.user_errors or self.signal_received is not None):
                return  # the rest is ranks being stopped; the caller says what happened once
            stream.write(text if text.endswith("\n") else text + "\n")
            stream.flush()

    def _relay(self, node: _Node, pipe: IO[bytes], is_stderr: bool) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            if is_stderr:
                marker = line.find(FAILURE_MARKER)
                if marker >= 0:
                    try:
                        report = json.loads(line[marker + len(FAILURE_MARKER):])
                    except json.JSONDecodeError:
                        report = None
                    if isinstance(report, dict):
                        with self.lock:
                            self.reports.append(report)
                        continue
                problems = parse_user_error(line) if self.outcome is not None else None
                if problems:
                    with self.lock:
                        self.outcome.user_errors.extend(p for p in problems if p not in self.outcome.user_errors)
                    if self.quiet:
                        continue
                node.stderr_tail.append(line.rstrip("\n"))
            self._write(self.err if is_stderr else self.out, node, line)
        pipe.close()

    # ---- processes -------------------------------------------------------------------------------

    def start(self) -> None:
        env = runner_environment(self.plan.runner, self.plan.options, dict(os.environ))
        for command in self.plan.commands:
            process = subprocess.Popen(
                list(command.argv), cwd=self.plan.options.cwd, env=env,
                stdin=subprocess.PIPE if self.plan.runner == "ssh" else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
            node = _Node(command, process)
            for pipe, is_stderr in ((process.stdout, False), (process.stderr, True)):
                thread = threading.Thread(target=self._relay, args=(node, pipe, is_stderr), daemon=True)
                thread.start()
                node.threads.append(thread)
            self.nodes.append(node)

    def ask_to_stop(self) -> None:
        for node in self.nodes:
            if node.process.poll() is not None:
                continue
            if node.process.stdin is not None:
                try:
                    node.process.stdin.close()  # the remote agent watches stdin and stops on EOF
                except OSError:
                    pass
            else:  # the signal the launcher got (Ctrl-C stays Ctrl-C, SIGUSR1 a preemption), or SIGTERM
                try:
                    node.process.send_signal(self.signal_received or signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def kill_all(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                try:
                    node.process.kill()
                except ProcessLookupError:
                    pass

    def wait(self) -> None:
        stop_deadline: float | None = None
        terminated = False
        while True:
            codes = [node.process.poll() for node in self.nodes]
            if all(code is not None for code in codes):
                break
            failed = any(code not in (None, 0) for code in codes)
            if failed and self.plan.options.elastic_training:
                self._note_left_nodes()
                failed = False  # the others carry on; the job ends when they do
            if stop_deadline is None and (failed or self.signal_received is not None):
                self.ask_to_stop()
                stop_deadline = time.monotonic() + self.stop_grace
            if stop_deadline is not None and not terminated and time.monotonic() > stop_deadline - self.stop_grace / 2:
                for node in self.nodes:  # ssh clients that ignored the closed stdin get a signal too
                    if node.process.poll() is None:
                        node.process.send_signal(signal.SIGTERM)
                terminated = True
            if stop_deadline is not None and (time.monotonic() > stop_deadline or self.signals > 1):
                self.kill_all()
                stop_deadline = float("inf")
            time.sleep(0.1)
        for node in self.nodes:
            for thread in node.threads:
                thread.join(timeout=5)

    def _note_left_nodes(self) -> None:
        for node in self.nodes:
            code = node.process.poll()
            if code in (None, 0) or node.left_noted:
                continue
            node.left_noted = True
            running = sum(1 for n in self.nodes if n.process.poll() is None)
            self.err.write(f"dsrun: {node.command.label} left the elastic job (exit code {code}); {running} node "
                           f"command(s) still run. A node joins with: {self.plan.join_command()}\n")
            self.err.flush()

    # ---- outcome ---------------------------------------------------------------------------------

    def root_cause(self) -> dict[str, Any] | None:
        """The report that explains the failure: a rank's own failure beats an agent's "stopped" note."""
        rank_failures = [r for r in self.reports if r.get("rank") is not None]
        if rank_failures:
            # agents repeat the cause they read from the job store; the one most of them name wins, the
            # earliest received breaks ties
            last_round = max(r.get("round", 0) for r in rank_failures)
            in_round = [r for r in rank_failures if r.get("round", 0) == last_round]
            votes = Counter((r["rank"], r.get("exitcode")) for r in in_round)
            return max(in_round, key=lambda r: votes[(r["rank"], r.get("exitcode"))])
        return self.reports[0] if self.reports else None

    def summarize(self) -> int:
        code = self._summarize()
        if self.outcome is not None:
            self.outcome.exit_code, self.outcome.signal = code, self.signal_received
            cause = self.root_cause()
            self.outcome.failed_rank = cause.get("rank") if cause is not None else None
        return code

    def _summarize(self) -> int:
        if self.outcome is not None and self.signal_received is not None:
            return 128 + self.signal_received  # the caller says what stopped and what was saved
        if self.quiet and self.outcome.user_errors:
            return EXIT_USAGE
        if self.signal_received is not None:
            self.err.write(stopped_message(self.plan, self.signal_received) + "\n")
            return 128 + self.signal_received
        codes = [node.process.returncode for node in self.nodes]
        if all(code == 0 for code in codes) and not self.reports:
            return 0
        if self.plan.options.elastic_training and 0 in codes:
            return 0  # the nodes of the last round finished the job; the others had left it
        cause = self.root_cause()
        stopped = cause is not None and cause.get("exitcode") in (EXIT_PREEMPTED, EXIT_STOPPED)
        if self.outcome is not None and stopped:
            return cause["exitcode"]  # a rank got a stop signal itself and the ranks stopped: the caller says how
        lines: list[str] = []
        if cause is not None:
            lines.append(f"dsrun: job failed: {cause['message']}")
            for log in cause.get("logs") or []:
                lines.append(f"dsrun: last lines of rank {cause['rank']}'s log {log['path']}:")
                lines.extend(f"    {line}" for line in log["tail"])
            code = exit_code_for(cause["exitcode"]) if cause.get("exitcode") else 1
        else:
            bad = next(node for node in self.nodes if node.process.returncode != 0)
            what = {"ssh": "ssh", "local": "the agent", "no_ssh": "the agent"}.get(self.plan.runner,
                                                                                    bad.command.argv[0])
            code_text = str(bad.process.returncode)
            if bad.process.returncode < 0:
                code_text += f" ({signal.Signals(-bad.process.returncode).name})"
            lines.append(f"dsrun: job failed: {what} for {bad.command.label} exited with code {code_text} "
                         f"before any rank reported")
            lines.extend(f"    {line}" for line in bad.stderr_tail)
            code = exit_code_for(bad.process.returncode) if bad.process.returncode else 1
        lines.append(f"dsrun: stopped all ranks on {len(self.plan.hosts)} host(s)")
        self.err.write("\n".join(lines) + "\n")
        self.err.flush()
        return code


def stopped_message(plan: LaunchPlan, signum: int) -> str:
    """The line that says a job was stopped by ``signum``."""
    return f"dsrun: stopped by {signal.Signals(signum).name}; all ranks on {len(plan.hosts)} host(s) were stopped"


def check_ssh(plan: LaunchPlan) -> None:
    """Fail early, naming the hosts, when passwordless ssh does not work (BatchMode: never prompts)."""
    from dsrun.launcher.runners import ssh_argv

    def probe(host: str) -> tuple[str, int, str]:
        argv = ssh_argv(plan.options, host, "true")
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=SSH_CHECK_TIMEOUT)
        except subprocess.TimeoutExpired:
            return host, -1, f"no answer within {SSH_CHECK_TIMEOUT:.0f} s"
        return host, done.returncode, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""

    with ThreadPoolExecutor(max_workers=min(32, len(plan.hosts))) as pool:
        results = list(pool.map(probe, plan.hosts))
    problems = [Problem(f"ssh {host}", f"failed ({detail or f'exit code {code}'})",
                        "set up passwordless ssh, or pass --no_ssh_check to skip this check")
                for host, code, detail in results if code != 0]
    if problems:
        raise UserError(problems)


def _check_tools(plan: LaunchPlan) -> None:
    tool = RUNNER_TOOLS.get(plan.runner)
    if tool and shutil.which(tool) is None:
        raise UserError(Problem("--launcher", f"the {plan.runner} runner needs {tool!r}, which is not on PATH"))


def run(plan: LaunchPlan, *, out: IO[str] | None = None, err: IO[str] | None = None,
        outcome: JobOutcome | None = None) -> int:
    """Run ``plan`` to completion and return the job's exit code (0 when every rank succeeded); ``outcome``,
    when given, receives how it ended and the caller words it (see the module docstring).

    Raises :class:`UserError` before starting anything when a runner's tool is missing or (ssh runner,
    unless ``no_ssh_check``) a host does not accept passwordless ssh.
    """
    _check_tools(plan)
    if plan.runner == "ssh" and not plan.options.no_ssh_check:
        check_ssh(plan)
    for path, text in plan.files.items():  # e.g. mvapich's list of hosts
        with open(path, "w") as handle:
            handle.write(text)
    job = _Job(plan, out or sys.stdout, err or sys.stderr, outcome)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum: int, frame: types.FrameType | None) -> None:
            job.signal_received = signum
            job.signals += 1

        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, on_signal)
    try:
        job.start()
        job.wait()
    finally:
        job.kill_all()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for path in plan.files:
            try:
                os.unlink(path)
            except OSError:
                pass
    return job.summarize()
