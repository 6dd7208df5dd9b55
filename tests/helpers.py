"""Helpers shared by the test suite: free ports, running the CLI, and bounded multi-rank runs."""
from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]
CORES = os.cpu_count() or 1
# The programs some tests run and the Debian package of each; tests/run installs these packages (as root).
SYSTEM_PACKAGES = {"sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
                   "ip": "iproute2", "mpirun": "openmpi-bin",
                   # a real one-node Slurm cluster (tests/e2e/slurm): its daemons and clients, and munge's
                   "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "srun": "slurm-wlm",
                   "sinfo": "slurm-wlm", "scontrol": "slurm-wlm", "scancel": "slurm-wlm", "squeue": "slurm-wlm",
                   "munged": "munge", "mungekey": "munge"}


def require_programs(*programs: str) -> dict[str, str]:
    """Each program's path on ``$PATH``; skips the calling test when one is missing, naming the Debian
    packages to install (a fresh machine lacks them until ``tests/run`` installs them)."""
    import pytest

    found = {name: shutil.which(name) for name in programs}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        packages = sorted({SYSTEM_PACKAGES[name] for name in missing})
        pytest.skip(f"needs {', '.join(missing)}: apt-get install {' '.join(packages)} (tests/run installs them "
                    "as root)")
    return {name: str(path) for name, path in found.items()}


def require_built_op(name: str, simd: str | None = None) -> None:
    """Skips the calling test unless the compiled op ``name`` (at SIMD level ``simd``; None: the machine's) is
    built, prebuilt or in the op cache: no test compiles an op; ``tests/run`` and the session start
    (tests/conftest.py) build them before the first test."""
    import pytest

    from op_builder import get_builder

    saved = os.environ.get("DSRUN_SIMD")
    if simd is not None:
        os.environ["DSRUN_SIMD"] = simd
    try:
        built = get_builder(name).is_built()
    finally:
        if saved is None:
            os.environ.pop("DSRUN_SIMD", None)
        else:
            os.environ["DSRUN_SIMD"] = saved
    if not built:
        env = f"DSRUN_SIMD={simd} " if simd else ""
        pytest.skip(f"op {name} is not built: {env}python -m dsrun ops build {name} (the session start builds it)")


def free_port() -> int:
    """A TCP port that is free right now, below the kernel's ephemeral range (dsrun.utils.net.free_port): the
    ranks' gloo connections of a test on the other worker cannot take it before this test's store binds it."""
    from dsrun.utils.net import free_port as below_the_ephemeral_range

    return below_the_ephemeral_range()


def signal_when(args: Sequence[str], cwd: Path, seen: str, signum: int, *, group: bool,
                env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str, str]:
    """Run ``python -m dsrun ARGS`` in its own session and, once ``seen`` appears on its stdout, send ``signum``
    to the whole process group (``group``: as Ctrl-C in a terminal does) or to that process only (as a scheduler
    signals a job's main process). Returns (exit code, stdout, stderr)."""
    import signal

    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, "-m", "dsrun", *args], cwd=cwd, env=full_env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.monotonic() + timeout
    out = []
    try:
        for line in process.stdout:
            out.append(line)
            if seen in line:
                if group:
                    os.killpg(process.pid, signum)
                else:
                    process.send_signal(signum)
                break
            assert time.monotonic() < deadline, "".join(out)[-3000:]
        rest, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, "".join(out) + rest, err


def run_cli(*args: str, cwd: str | Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m dsrun ARGS`` as a user would; stdout/stderr captured as text."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "dsrun", *args], cwd=cwd, env=full_env, text=True,
                          capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)


# Rank processes are forked from a server process that has imported torch once (multiprocessing's forkserver),
# not started fresh: each rank skips torch's import (about a second of CPU; hundreds of ranks in the suite).
# A forked rank is still a new process with the parent's environment, working folder and import path
# (_rank_entry puts the environment back: the server's is the one it started with), and the server has
# imported modules only, run no operator, so no thread pool exists to be forked; a rank runs the interpreter's
# exit handlers itself (a forked child ends with os._exit, skipping them). The server's standard output
# is whatever the test that started it had, so each rank writes its output to a file of its launch, which the
# caller prints (pytest shows it with the test's output) and quotes when a rank fails. torch._dynamo too: the
# first torch optimizer a rank builds imports it (torch.optim's _disable_dynamo; dsrun's own do not:
# dsrun/utils/dynamo_free.py), ~1.2 s of CPU per rank; importing it starts no thread either. And dsrun's rank
# side, which every rank would import again (~300 modules, 0.5-0.8 s
# of CPU per rank; measured: tests/integration/test_preemption.py's 18 ranks 25.6 -> 12.3 CPU-s, loaded): the
# worker, the engine with its built-in features and ZeRO strategies, the data and optimizer modules. A dsrun
# module reads the environment only when called, never at import (tests/unit/test_architecture.py), so a rank
# still sees its own, and starts no thread.
_PRELOAD = ["torch", "torch._dynamo", "dsrun.worker", "dsrun.engine.initialize", "dsrun.engine.engine",
            "dsrun.engine.builtin_features", "dsrun.zero.strategies", "dsrun.data.corpus", "dsrun.data.sampler",
            "dsrun.optim.lr_schedules", "dsrun.ops.adam"]


def _rank_context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_entry(fn: Callable, rank: int, world_size: int, port: int, threads: int, results: Any,
                args: Sequence[Any], environ: dict[str, str], log: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(threads))
    import torch

    torch.set_num_threads(threads)
    try:
        # pickled here, by value: through the queue torch would share a tensor's storage by a file descriptor
        # that its (by then maybe exited) process must still serve, and the parent's read would fail
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # a forked rank ends with os._exit, which skips the interpreter's exit handlers; run them, as a spawned
        # rank's normal exit would (weakref.finalize cleanups: swap folders, temporary files)
        atexit._run_exitfuncs()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes with the torch.distributed
    environment variables set (gloo on 127.0.0.1, a free port), threads split across the cores.

    Returns each rank's return value (picklable), in rank order. Raises AssertionError with the rank's
    traceback if any rank fails, and kills every rank (by PID) if they do not all finish in ``timeout``
    seconds, so a hang fails the test instead of stalling CI. ``fn`` must be importable (module level).
    """
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    threads = max(1, CORES // world_size)
    environ = dict(os.environ)
    logs = Path(tempfile.mkdtemp(prefix="dsrun-test-ranks-"))
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, threads, results, args, environ,
                                                   str(logs / f"rank{r}.log")), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        _collect(procs, results, outcome, errors, world_size, timeout, deadline)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{_rank_output(logs, tail=3000)}") from None
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        sys.stdout.write(_rank_output(logs))  # into the test's captured output, as a child's own would go
        shutil.rmtree(logs, ignore_errors=True)
    return [outcome[r] for r in range(world_size)]


def _rank_output(logs: Path, tail: int | None = None) -> str:
    parts = []
    for path in sorted(logs.glob("rank*.log")):
        text = path.read_text(errors="replace")
        if text:
            parts.append(f"--- {path.stem} output ---\n{text[-tail:] if tail else text}")
    return "\n".join(parts) + ("\n" if parts else "")


def _collect(procs: list[Any], results: Any, outcome: dict[int, Any], errors: list[str], world_size: int,
             timeout: float, deadline: float) -> None:
    """Wait for every rank's report (filling ``outcome`` and ``errors``); AssertionError on a failure, a rank
    that died without reporting, or the deadline."""
    while len(outcome) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"ranks did not finish within {timeout}s "
                                 f"(finished: {sorted(outcome)}; errors: {len(errors)})")
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and len(outcome) + len(errors) < world_size:
                # a rank died without reporting (segfault, os._exit): give the queue a moment, then fail
                try:
                    rank, status, value = results.get(timeout=2.0)
                except queue.Empty:
                    raise AssertionError(
                        f"rank process exited with code {dead[0].exitcode} without reporting") from None
            else:
                continue
        if status == "ok":
            outcome[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank} failed:\n{value}")
            break  # one failure is enough; the others may now hang in a collective
    if errors:
        raise AssertionError("\n".join(errors))


_FIRST_OUTPUT_PROBE = """
import json, sys

HEAVY = ("torch", "hydra", "mlflow", "sqlalchemy", "transformers", "optuna", "tensorboard")
seen = {}


class FirstLine:
    \"\"\"A console stream that notes which heavy modules were loaded when the command printed its first line.\"\"\"

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if "loaded" not in seen and text.strip():
            seen.update(loaded=[m for m in HEAVY if m in sys.modules], line=text.strip(), modules=len(sys.modules))
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


sys.stdout, sys.stderr = FirstLine(sys.stdout), FirstLine(sys.stderr)
from dsrun.cli.__main__ import main

seen["code"] = main(sys.argv[1:])
sys.__stdout__.write("@@" + json.dumps(seen) + "\\n")
"""


def first_output_probe(*args: str, cwd: str | Path) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    """Run ``dsrun ARGS`` in a fresh interpreter and report, for its first printed line (stdout or stderr), the
    line, how many modules were loaded and which heavy ones (torch, Hydra, MLflow, ...): ``({"line", "modules",
    "loaded", "code"}, the completed process)``."""
    result = subprocess.run([sys.executable, "-c", _FIRST_OUTPUT_PROBE, *args], cwd=cwd, text=True,
                            capture_output=True, timeout=300, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(result.stdout.rsplit("@@", 1)[1]), result


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax, e.g. "3m") mounted at ``path`` (made), unmounted and removed on
    exit: a real full disk (ENOSPC) without filling the machine's. Skips when this process may not mount."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
        path.rmdir()
