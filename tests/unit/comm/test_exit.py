"""A script that never destroys its process group has it torn down at exit by dsrun.comm (gloo's threads
otherwise meet the interpreter's static destructors, which can abort a finished rank)."""
import subprocess
import sys

from tests.helpers import REPO

SCRIPT = """
import atexit
import torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))  # runs last
import dsrun
dsrun.init_distributed(dist_backend="gloo", verbose=False)
print("initialized:", dist.is_initialized(), flush=True)
"""


def test_the_default_group_is_destroyed_at_exit():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["initialized: True", "initialized at exit: False"]
