"""A rank whose work is done ends through ``exit_without_teardown``: what a normal exit guarantees still happens (its exit
code, non-daemon threads finished, atexit handlers run, buffered output written), the interpreter's teardown
(every module's objects freed one by one, seconds of CPU on a busy machine for torch, MLflow and SQLAlchemy)
does not."""
import subprocess
import sys
import textwrap

from tests.helpers import REPO

RANK = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

from dsrun.launcher.protocol import exit_without_teardown


class TornDown:
    def __del__(self):  # runs only when the interpreter tears its modules down
        sys.__stderr__.write("torn down\\n")


kept_until_teardown = TornDown()
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()  # not a daemon
pool = ThreadPoolExecutor(2)  # idle workers left running, as a library may leave them: a normal exit ends them
pool.submit(lambda: None).result()
print("buffered, not flushed", end="")
exit_without_teardown(3)
"""


def test_exit_without_teardown_keeps_a_normal_exits_guarantees_and_skips_the_teardown():
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(RANK)], cwd=REPO, capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)  # hung, before, on the pool's idle workers
    assert result.returncode == 3, result.stderr
    assert result.stdout.splitlines() == ["buffered, not flushedthread finished", "atexit ran"]
    assert "torn down" not in result.stderr and "Traceback" not in result.stderr
