"""Running a plan with a JobOutcome: a rank's report of a user's mistake is collected once, the noise of the
ranks being stopped after it is not relayed (unless DSRUN_DEBUG=1), and the summary lines are left out."""
import dataclasses
import io
import sys

import pytest

from dsrun.launcher import JobOutcome, LaunchOptions, plan_launch, run
from dsrun.launcher.protocol import DEBUG_ENV, USER_ERROR_MARKER, parse_user_error
from dsrun.launcher.runners import NodeCommand

NODE = """
import json, sys
print("[rank0]:starting", flush=True)
for rank in (0, 1):  # every rank finds the same mistake
    sys.stderr.write("[rank%d]:%s%s\\n" % (rank, {marker!r}, json.dumps({{"problems": ["data.path: gone (fix it)"]}})))
    sys.stderr.flush()
sys.stderr.write("[rank1]:Traceback (most recent call last): gloo noise\\n")
sys.stderr.write("W1124 torch elastic: Sending process 1 closing signal SIGTERM\\n")
sys.exit(2)
"""


def _plan(script: str):
    plan = plan_launch(LaunchOptions(target="json.tool", module=True, num_procs=1, master_port=29999))
    command = NodeCommand(("localhost",), (sys.executable, "-c", script), 0)
    return dataclasses.replace(plan, commands=[command])


@pytest.mark.parametrize("debug", [False, True])
def test_a_user_error_is_collected_once_and_the_noise_after_it_is_hidden(monkeypatch, debug):
    if debug:
        monkeypatch.setenv(DEBUG_ENV, "1")
    else:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    out, err, outcome = io.StringIO(), io.StringIO(), JobOutcome()
    code = run(_plan(NODE.format(marker=USER_ERROR_MARKER)), out=out, err=err, outcome=outcome)
    assert code == outcome.exit_code == 2 and outcome.signal is None
    assert outcome.user_errors == ["data.path: gone (fix it)"]
    assert "[rank0]:starting" in out.getvalue()
    assert ("gloo noise" in err.getvalue()) is debug and ("closing signal" in err.getvalue()) is debug
    assert "job failed" not in err.getvalue() or debug


def test_without_an_outcome_the_job_reports_as_before():
    out, err = io.StringIO(), io.StringIO()
    code = run(_plan(NODE.format(marker=USER_ERROR_MARKER)), out=out, err=err)
    assert code == 2 and "gloo noise" in err.getvalue() and "dsrun: job failed" in err.getvalue()


def test_parse_user_error_finds_the_marker_behind_prefixes():
    line = f"[node1] [rank3]:{USER_ERROR_MARKER}" + '{"problems": ["a: b"]}'
    assert parse_user_error(line) == ["a: b"]
    assert parse_user_error("no marker here") is None
    assert parse_user_error(f"{USER_ERROR_MARKER}not json") is None


GLOO = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:23969. This is typically caused by a remote worker crashing.")


def test_the_failure_line_names_the_rank_that_failed_first_not_a_peer_that_lost_it(tmp_path):
    """Rank 0 only lost its peer (gloo's "Connection closed by peer"); ranks 5 and 10 hold the cause."""
    from dsrun.cli.outcome import first_error

    (tmp_path / "rank0.stderr.log").write_text(f"Traceback (most recent call last):\n[rank0]: {GLOO}\n")
    (tmp_path / "rank1.stderr.log").write_text("no traceback here\n")
    for rank in (5, 10):
        (tmp_path / f"rank{rank}.stderr.log").write_text(
            "Traceback (most recent call last):\nValueError: optimizer got an empty parameter list\n")
    assert first_error(tmp_path) == " (rank5: ValueError: optimizer got an empty parameter list)"
    assert first_error(tmp_path, rank=10) == " (rank10: ValueError: optimizer got an empty parameter list)"
    assert first_error(tmp_path, rank=0) == " (rank5: ValueError: optimizer got an empty parameter list)"
    for rank in (5, 10):
        (tmp_path / f"rank{rank}.stderr.log").unlink()
    assert first_error(tmp_path).startswith(" (rank0: RuntimeError: [") and "Connection closed by peer" in \
        first_error(tmp_path)  # only consequences: still say what there is


def test_the_outcome_names_the_rank_the_agents_found_failed_first():
    script = ("import sys; sys.stderr.write({marker!r} + '{{\"rank\": 3, \"exitcode\": 1, \"message\": "
              "\"rank 3 exited with exit code 1\", \"logs\": []}}\\n'); sys.exit(1)")
    from dsrun.launcher.protocol import FAILURE_MARKER

    outcome = JobOutcome()
    code = run(_plan(script.format(marker=FAILURE_MARKER)), out=io.StringIO(), err=io.StringIO(), outcome=outcome)
    assert code == 1 and outcome.failed_rank == 3 and outcome.user_errors == []


RANK_SCRIPT = """
import dsrun
from dsrun.utils.errors import ConfigError, Problem
dsrun.init_distributed(verbose=False)
raise RuntimeError("wrapped") from ConfigError(Problem("train_batch_size", "7 is not 2 * 1 * 2", "use 4 or 8"))
"""


@pytest.mark.parametrize("launched,debug", [(True, False), (True, True), (False, False)])
def test_a_user_error_a_users_script_does_not_catch_is_reported_to_the_launcher(tmp_path, launched, debug):
    """Under dsrun's launcher (DSRUN_RANK=1, set by rank_exec) a UserError, or an error it caused, that escapes a
    user's script is the marker line and exit code 2, even after torch.distributed wrapped sys.excepthook; a
    traceback only with --debug. Outside dsrun's launcher Python's own traceback and exit code 1 stay."""
    import os
    import subprocess

    from dsrun.launcher.protocol import RANK_ENV

    env = {k: v for k, v in os.environ.items() if k not in (RANK_ENV, DEBUG_ENV, "HYDRA_FULL_ERROR", "RANK",
                                                          "WORLD_SIZE", "MASTER_PORT")}
    env.update({RANK_ENV: "1"} if launched else {})
    env.update({DEBUG_ENV: "1"} if debug else {})
    done = subprocess.run([sys.executable, "-c", RANK_SCRIPT], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    problem = "train_batch_size: 7 is not 2 * 1 * 2 (use 4 or 8)"
    if not launched:
        assert done.returncode == 1 and "Traceback" in done.stderr and USER_ERROR_MARKER not in done.stderr
        return
    assert done.returncode == 2, done.stderr
    marker_lines = [line for line in done.stderr.splitlines() if USER_ERROR_MARKER in line]
    assert len(marker_lines) == 1 and parse_user_error(marker_lines[0]) == [problem]
    assert f"error: {problem}" in done.stderr
    assert ("Traceback (most recent call last)" in done.stderr) is debug
