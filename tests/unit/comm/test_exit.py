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


# The threads a gloo world runs (its workers and transport loop; the TCPStore server on rank 0): a destroyed
# world whose threads live on is torn down by the interpreter's exit in no defined order and may abort there.
THREADS = """
import os
GLOO = ("pt_gloo", "gloo_tcp", "pt_tcpstore")
def world_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if n.startswith(GLOO))
"""

# vs_deepspeed's rank: dsrun's engine (building its optimizer imports torch.distributed.nn.functional, whose
# ``group=group.WORLD`` defaults would pin the world), then torch's own destroy_process_group
ENGINE_THEN_TORCH_DESTROY = THREADS + """
import gc, torch, torch.distributed as dist
import dsrun as deepspeed
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 2}})
loss = engine(torch.ones(2, 8)).sum(); engine.backward(loss); engine.step()
import torch.distributed.nn.functional as F
print("pinned:", any(isinstance(d, dist.ProcessGroup) for d in F.broadcast.__defaults__), flush=True)
print("before:", bool(world_threads()), flush=True)
dist.barrier(); dist.destroy_process_group(); gc.collect()
print("after:", world_threads(), flush=True)
"""

# a world created by torch before dsrun is imported, pinned by that import, destroyed by the script with torch's
# destroy_process_group: dsrun's exit hook releases it while the interpreter is whole
PINNED_BEFORE_DSRUN = THREADS + """
import atexit, gc, os, socket
import torch.distributed as dist
atexit.register(lambda: print("at exit:", world_threads(), flush=True))  # registered first: runs last
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
import torch.distributed.nn  # pins the world in its functions' defaults
import dsrun
dsrun.init_distributed(verbose=False)
dist.destroy_process_group(); gc.collect()
print("destroyed, still running:", bool(world_threads()), flush=True)
"""


def _run(script: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_destroying_the_world_after_an_engine_ends_its_threads_before_exit():
    assert _run(ENGINE_THEN_TORCH_DESTROY) == ["pinned: False", "before: True", "after: []"]


def test_a_world_pinned_before_dsrun_was_imported_is_released_at_exit():
    # torch keeps the pinned world alive past destroy_process_group (first line); dsrun's exit hook frees it
    assert _run(PINNED_BEFORE_DSRUN) == ["destroyed, still running: True", "at exit: []"]
