"""``dsrun train`` under a real torchrun becomes torchrun's rank (docs/torchrun.md): the ZeRO-3 recipe's job as
dsrun's own launcher trains it (same per-step losses, same run directory files), a conflicting launcher key is
one line and exit code 2, two torchrun nodes in network namespaces (c10d rendezvous) train the same job too, and SIGTERM to one
rank stops both at a step boundary with a checkpoint there (preemption, docs/cluster.md).

torchrun is torch's own (``python -m torch.distributed.run``, what the ``torchrun`` script runs); gloo meets on
127.0.0.1 at a free port; every wait is bounded by a subprocess timeout."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, require_programs, run_cli

# The job: the ZeRO-3 recipe (parameters partitioned across the ranks torchrun made), briefly.
SHORT = ["+recipe=gpt_zero3", "train.max_steps=3", "train.eval_iters=1", "train.eval_interval=0",
         "data.max_bytes=300000"]
TIMEOUT = 240


def torchrun(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = TIMEOUT,
             wrap: list[str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun ARGS`` (``-m dsrun train ...``) with this checkout importable; ``wrap`` runs it inside another
    command (a network namespace)."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH", "")]))
    argv = [*(wrap or []), sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.run(argv, cwd=cwd, env=full_env, text=True, capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def only_run_dir(folder: Path) -> Path:
    (run_dir,) = folder.glob("outputs/*/*")  # one run directory: the other ranks made none of their own
    return run_dir


def losses(run_dir: Path) -> list[tuple[int, float]]:
    with open(run_dir / "dsrun" / "Train_Samples_train_loss.csv") as handle:
        return [(int(row["step"]), float(row["train_loss"])) for row in csv.DictReader(handle)]


def files(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def dsrun_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job as dsrun's own launcher runs it: ``dsrun train launcher.num_procs=2``."""
    folder = tmp_path_factory.mktemp("dsrun_launcher")
    done = run_cli("train", "launcher.num_procs=2", f"launcher.master_port={free_port()}", *SHORT, cwd=folder,
                   timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return only_run_dir(folder)


@pytest.mark.slow
def test_torchrun_trains_the_same_job_as_dsrun_train(tmp_path, dsrun_run):
    done = torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "dsrun", "train", *SHORT,
                    cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    assert len(losses(run_dir)) == 3 and losses(run_dir) == losses(dsrun_run)  # equal, step by step
    assert files(run_dir) == files(dsrun_run)  # the same layout: logs/rank1.*, topology_rank1.json included
    assert (run_dir / "ds_config.json").read_text() == (dsrun_run / "ds_config.json").read_text()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 3
    # rank 0 wrote the run's files and said it once; rank 1 trained in rank 0's directory
    assert done.stdout.count("[dsrun] run directory") == 1
    assert "torchrun: WORLD_SIZE=2 (2 per node on 1 node(s))" in done.stdout
    assert "[dsrun] step 3/3" in (run_dir / "logs" / "rank0.stdout.log").read_text()
    assert "[dsrun] done: 3 steps" in (run_dir / "dsrun.log").read_text()


@pytest.mark.slow
def test_mpirun_trains_the_same_job_as_dsrun_train(tmp_path, dsrun_run):
    """Open MPI's variables make the ranks too: ``mpirun -np 2 python -m dsrun train`` (MASTER_PORT exported)."""
    mpirun = require_programs("mpirun")["mpirun"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port())}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run([mpirun, "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", "-x", "MASTER_PORT",
                           sys.executable, "-m", "dsrun", "train", *SHORT], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)
    assert losses(run_dir) == losses(dsrun_run) and files(run_dir) == files(dsrun_run)
    assert "mpirun: OMPI_COMM_WORLD_SIZE=2 (2 per node on 1 node(s))" in done.stdout


def test_a_recipe_asking_for_other_ranks_is_refused_under_torchrun(tmp_path):
    done = torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "dsrun", "train",
                    "launcher.num_procs=4", *SHORT, cwd=tmp_path, timeout=120)
    line = ("error: launcher.num_procs: is 4, but torchrun started 2 rank(s) per node (LOCAL_WORLD_SIZE=2) "
            "(set launcher.num_procs=2 or change the torchrun command)")
    # each rank refuses on its own, before meeting the other (one that waited would hang): the same one line
    assert done.returncode != 0 and 1 <= done.stderr.count(line) <= 2, done.stderr[-3000:]
    assert [l for l in done.stderr.splitlines() if l.startswith("error:")] == [line] * done.stderr.count(line)
    assert "exitcode  : 2" in done.stderr  # torchrun's report of the ranks' exit code
    assert f"{os.sep}dsrun{os.sep}" not in "".join(l for l in done.stderr.splitlines() if l.startswith('  File "'))
    assert not (tmp_path / "outputs").exists()  # refused before any run directory


def test_a_refusal_is_one_line_and_exit_code_2(tmp_path):
    """torch elastic's variables as torchrun sets them, without torchrun: the rank refuses before it meets any."""
    env = {"TORCHELASTIC_RUN_ID": "refusal", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    done = run_cli("train", "launcher.hostfile=myhosts", *SHORT, cwd=tmp_path, env=env,
                   timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: launcher.hostfile: is 'myhosts', which only dsrun's own launcher acts on, but torchrun started this "
        "rank (the outer launcher chose the nodes; set launcher.hostfile=null)"]
    agreeing = run_cli("train", "--dry-run", "launcher.num_procs=2", cwd=tmp_path, env=env, timeout=120)
    assert agreeing.returncode == 2 and agreeing.stderr.splitlines() == [
        "error: --dry-run: is not run as a rank of torchrun (RANK=0) (run dsrun train --dry-run outside torchrun)"]


@pytest.mark.slow
@pytest.mark.multihost
def test_two_torchrun_nodes_in_network_namespaces(two_hosts, tmp_path, dsrun_run):
    """``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d`` in each of two namespaces: one rank per
    "machine", meeting over the veth pair; the same losses as dsrun's own two local ranks."""
    from tests.integration.launcher.conftest import INTERFACE

    port = free_port()
    env = {"GLOO_SOCKET_IFNAME": INTERFACE, "OMP_NUM_THREADS": "1"}  # dsrun's launcher gives each rank 1 of 2 cores
    processes = []
    for host in (two_hosts.a, two_hosts.b):
        argv = two_hosts.in_namespace(host, [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{two_hosts.a.address}:{port}", "--rdzv-id", "two-nodes",
            "--rdzv-conf", f"is_host={int(host is two_hosts.a)}",  # the hostname resolves to loopback everywhere
            "--local-addr", host.address, "-m", "dsrun", "train", "launcher.num_procs=1", *SHORT])
        full_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
        processes.append(subprocess.Popen(argv, cwd=tmp_path, env=full_env, text=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=TIMEOUT))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0, out[-3000:] + err[-3000:]
    run_dir = only_run_dir(tmp_path)
    assert losses(run_dir) == losses(dsrun_run)
    assert files(run_dir) == files(dsrun_run)
    assert "torchrun: WORLD_SIZE=2 (1 per node on 2 node(s))" in (run_dir / "dsrun.log").read_text()


RANK_SCRIPT = """\
import json, os, sys
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "TORCHELASTIC_RUN_ID")
with open(f"rank{os.environ['RANK']}.json", "w") as handle:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}, handle)
"""


def test_a_script_under_dsrun_launch_becomes_torchruns_rank(tmp_path):
    (tmp_path / "report.py").write_text(RANK_SCRIPT)
    done = torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "dsrun", "launch",
                    "--num_procs", "2", "report.py", "--lr", "0.1", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):  # the script is the rank itself: no agent of dsrun's between
        assert report["env"]["RANK"] == str(rank) and report["env"]["WORLD_SIZE"] == "2"
        assert report["env"]["CROSS_SIZE"] == "1" and report["env"]["TORCHELASTIC_RUN_ID"]
        assert report["argv"] == ["--lr", "0.1", f"--local_rank={rank}"]
    refused = torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "dsrun", "launch",
                       "--num_procs", "4", "report.py", cwd=tmp_path, timeout=120)
    line = ("error: --num_procs: is 4, but torchrun started 2 rank(s) per node (LOCAL_WORLD_SIZE=2) "
            "(set --num_procs 2 or change the torchrun command)")
    assert refused.returncode != 0 and line in refused.stderr and "exitcode  : 2" in refused.stderr


ALIAS_SCRIPT = """import json, os, sys
import deepspeed
with open("alias.json", "w") as handle:
    json.dump({"deepspeed": deepspeed.__name__, "dsrun": deepspeed.DeepSpeedEngine.__module__,
               "path": os.environ["PATH"]}, handle)
"""


def test_as_deepspeed_under_torchrun_leaves_no_temporary_folder(tmp_path):
    """Under an outer launcher ``dsrun launch --as-deepspeed`` execs the script with the alias on its path; it
    writes no temporary ``deepspeed`` bin folder, which nobody would be left to remove (the rank's process is
    replaced by the script)."""
    (tmp_path / "alias.py").write_text(ALIAS_SCRIPT)
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = torchrun("--nproc-per-node", "1", "--master-port", str(free_port()), "-m", "dsrun", "launch",
                    "--as-deepspeed", "alias.py", cwd=tmp_path, env={"TMPDIR": str(temp)}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "alias.json").read_text())
    assert report["deepspeed"] == "deepspeed" and report["dsrun"].startswith("dsrun.")
    assert "dsrun-deepspeed-bin-" not in report["path"]
    assert not list(temp.glob("dsrun-deepspeed-bin-*"))


def _rank_pid(parent: int, rank: int) -> int | None:
    """The PID of the child of ``parent`` whose environment says ``RANK=rank`` (a rank torchrun started)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in environ:
            return int(stat.parent.name)
    return None


@pytest.mark.slow
def test_sigterm_to_one_rank_under_torchrun_stops_both_with_a_checkpoint_and_exit_138(tmp_path):
    """Preemption under torchrun (docs/cluster.md): SIGTERM to rank 1 alone; both ranks agree to stop at the next
    step boundary, save there (train.save_interval=0) and exit with 138, which torchrun reports as their exit code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    tiny = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.max_bytes=200000",
            "train.eval_iters=1", "train.eval_interval=0", "monitor=none", "train.max_steps=500", "ds.steps_per_print=1"]
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                "--master-port", str(free_port()), "-m", "dsrun", "train", *tiny], cwd=tmp_path,
                               env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        for line in process.stdout:
            if "[dsrun] step 2/500" in line:
                os.kill(_rank_pid(process.pid, 1), signal.SIGTERM)
                break
        _, err = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    run_dir = only_run_dir(tmp_path)
    record = json.loads((run_dir / "preempted.json").read_text())
    step = record["step"]
    assert record["signal"] == "SIGTERM" and record["saved"] and step >= 2, err[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"global_step{step}"
    assert (f"[dsrun] stopped by SIGTERM after step {step} of 500; checkpoint saved at step {step}"
            in (run_dir / "dsrun.log").read_text())
    assert "exitcode  : 138" in err, err[-3000:]  # torchrun's summary of the ranks' exit codes
    assert process.returncode != 0  # torchrun's own: a failed group (with --max-restarts it restarts, resuming)
