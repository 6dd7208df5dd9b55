"""What the launcher and the node agents agree on: how the world is passed to an agent, how an agent
reports a failure (one ``@@dsrun-failure@@ {json}`` line on stderr), how a rank reports a mistake of the
user's (one ``@@dsrun-user-error@@ {json}`` line on stderr, then exit code 2), how exit codes are derived,
and which signals stop a run (:data:`STOP_SIGNALS`; :data:`PREEMPTION_SIGNALS` make it save where it stops and
exit with :data:`EXIT_PREEMPTED`).

A rank of a user's own script reports its mistakes the same way: every rank dsrun starts has ``DSRUN_RANK=1``
(set by :mod:`dsrun.launcher.rank_exec`), and ``dsrun.init_distributed`` / ``dsrun.initialize`` install
:func:`install_user_error_hook`, so a :class:`~dsrun.utils.errors.UserError` the script does not catch becomes
that marker and exit code 2, not a traceback per rank.

Kept free of torch imports so the launcher can use it cheaply.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import sys
import types
from typing import IO, Any

FAILURE_MARKER = "@@dsrun-failure@@ "
USER_ERROR_MARKER = "@@dsrun-user-error@@ "
RANK_ENV = "DSRUN_RANK"  # "1" in every rank dsrun's launcher starts
DEBUG_ENV = "DSRUN_DEBUG"  # "1": show tracebacks and torch elastic's own log lines (dsrun --debug sets it)
TAIL_LINES = 20

# A scheduler's notice that the job is about to lose its machines: SIGTERM (Kubernetes' pod termination, Slurm's
# preemption and time limit, Ray's) and SIGUSR1 (Slurm's ``--signal=USR1@SECONDS``). The ranks finish their step
# and save a checkpoint there, whether periodic saving is on or not (docs/cluster.md). SIGINT (Ctrl-C) stops a
# run too, saving only when periodic saving is on.
PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, *PREEMPTION_SIGNALS)
# Preempted, checkpoint saved where the ranks stopped: requeue the job, the same command resumes. 128 + SIGUSR1:
# Kubeflow's ExitCode restart policy names 138 the user's retryable code (its newer rule retries every code from
# 128), and Slurm's RequeueExit or a Kubernetes Job's podFailurePolicy can name it; distinct from 143 (stopped by
# a signal without such a checkpoint), 130 (Ctrl-C) and 137 (killed).
EXIT_PREEMPTED = 138
EXIT_STOPPED = 128 + signal.SIGTERM  # stopped by a signal, no checkpoint where it stopped (a rank's exit code)


def encode_world_info(hosts: dict[str, Any]) -> str:
    """``{host: [slots]}`` (or slot counts) as URL-safe base64 JSON: safe to pass through any shell unquoted."""
    return base64.urlsafe_b64encode(json.dumps(hosts).encode()).decode()


def decode_world_info(text: str) -> dict[str, list[int]]:
    return json.loads(base64.urlsafe_b64decode(text.encode()).decode())


def exit_code_for(exitcode: int) -> int:
    """The launcher's exit code for a rank's exit code (negative: killed by that signal)."""
    if exitcode < 0:
        return 128 + (-exitcode)
    return exitcode if 0 < exitcode < 256 else 1


def log_tails(paths: list[str], lines: int = TAIL_LINES) -> list[dict[str, Any]]:
    """``[{"path": ..., "tail": [last lines]}]`` for each of ``paths`` that has any content."""
    tails = []
    for path in paths:
        try:
            with open(path, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - 64 * 1024))
                text = handle.read().decode(errors="replace")
        except OSError:
            continue
        if text.strip():
            tails.append({"path": path, "tail": text.rstrip("\n").splitlines()[-lines:]})
    return tails


def report_failure(report: dict[str, Any]) -> None:
    """Print one failure report for the launcher (a single line on stderr)."""
    sys.stderr.write(FAILURE_MARKER + json.dumps(report) + "\n")
    sys.stderr.flush()


def debug_requested() -> bool:
    """True when the user asked for tracebacks (``dsrun --debug`` exports ``DSRUN_DEBUG=1`` to the ranks;
    ``HYDRA_FULL_ERROR=1`` means the same)."""
    return os.environ.get(DEBUG_ENV) == "1" or os.environ.get("HYDRA_FULL_ERROR") == "1"


def report_user_error(problems: list[str], stream: IO[str] | None = None) -> None:
    """A rank's report of a mistake the user can fix (a :class:`~dsrun.utils.errors.UserError`): one marker
    line the launcher turns into one ``error:`` line per problem, then the problems as plain lines for the
    rank's own log (on ``stream``, by default stderr)."""
    stream = stream or sys.stderr
    stream.write(USER_ERROR_MARKER + json.dumps({"problems": problems}) + "\n")
    stream.write("".join(f"error: {problem}\n" for problem in problems))
    stream.flush()


def install_user_error_hook() -> None:
    """In a rank dsrun started (``RANK_ENV``): an uncaught :class:`~dsrun.utils.errors.UserError` (or an error it
    caused) is reported with :func:`report_user_error` and the rank exits with code 2 at once (the launcher
    words it once for all ranks; a traceback only on request). Anything else keeps Python's traceback.
    Installing it twice is harmless."""
    if os.environ.get(RANK_ENV) != "1" or getattr(sys.excepthook, "dsrun_user_errors", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: types.TracebackType | None) -> None:
        from dsrun.utils.errors import EXIT_USAGE, find_user_error

        user = find_user_error(value)
        if user is None:
            previous(kind, value, traceback)
            return
        # to the process's own stderr: torch.distributed wraps this hook and captures sys.stderr meanwhile
        stream = sys.__stderr__ or sys.stderr
        if debug_requested():
            import traceback as tb

            tb.print_exception(kind, value, traceback, file=stream)
        report_user_error([str(problem) for problem in user.problems], stream)
        sys.stdout.flush()
        os._exit(EXIT_USAGE)  # Python would exit with 1 after an uncaught exception; the atexit teardown of a
        # process group whose peers are failing too could only hang or add noise

    hook.dsrun_user_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def parse_user_error(line: str) -> list[str] | None:
    """The problems of a :func:`report_user_error` marker anywhere in ``line`` (a launcher or agent may have
    prefixed it), else None."""
    at = line.find(USER_ERROR_MARKER)
    if at < 0:
        return None
    try:
        report = json.loads(line[at + len(USER_ERROR_MARKER):])
    except json.JSONDecodeError:
        return None
    problems = report.get("problems") if isinstance(report, dict) else None
    return [str(p) for p in problems] if isinstance(problems, list) and problems else None


def exit_without_teardown(code: int) -> None:
    """End a process whose work is done (a rank, or the ``dsrun`` command) with ``code``, as a normal exit
    would but without the interpreter's teardown: threads that are not daemons are joined, the ``atexit``
    handlers run (monitors, logging) and the standard streams are flushed; then the process ends. The teardown
    frees, one by one, the thousands of modules torch (and on rank 0 MLflow and SQLAlchemy) import: 0.3-0.5 s
    of CPU per process on an idle machine, seconds each on a busy one, which the agent, ``dsrun train``'s
    ``done:`` and then the prompt waited for. Called from the main thread."""
    import atexit
    import threading

    # what the interpreter's own exit does first: the threading module's exit hooks (which let idle
    # concurrent.futures workers go; joining those without them waits forever), then every non-daemon thread
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to say on it
            pass
    os._exit(code)
