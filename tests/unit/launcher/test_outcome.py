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
