"""A rank an outer launcher made: torchrun's, srun's and mpirun's variables read into one world, and the
recipe's launcher keys checked against it (dsrun/launcher/outer.py, docs/torchrun.md)."""
from __future__ import annotations

import pytest

from dsrun.launcher import plan_from_mapping
from dsrun.launcher.outer import (detect_outer_launcher, launcher_conflicts, slurm_first_host,
                                  slurm_tasks_per_node)
from dsrun.runspec import describe_world
from dsrun.utils.errors import UserError

# what `torchrun --nnodes 2 --nproc-per-node 2` gives the second rank of the second node
TORCHRUN = {"TORCHELASTIC_RUN_ID": "job-7", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29400"}
# the fifth task of `srun -N 3 -n 5` (2, 2, 1 tasks per node): the only task of the third node
SRUN = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_PROCID": "4", "SLURM_NTASKS": "5",
        "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_STEP_NODELIST": "gpu[07-09]"}
# rank 2 of `mpirun -np 4` with 2 slots per host
MPIRUN = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node-a"}


def test_torchrun_variables_make_the_rank():
    outer = detect_outer_launcher(TORCHRUN)
    assert outer is not None and outer.launcher == "torchrun"
    assert (outer.rank, outer.world_size, outer.local_rank, outer.local_world_size) == (3, 4, 1, 2)
    assert (outer.node_rank, outer.num_nodes, outer.master_addr, outer.master_port) == (1, 2, "10.0.0.1", 29400)
    assert outer.environment()["CROSS_RANK"] == "1" and outer.environment()["CROSS_SIZE"] == "2"


def test_srun_task_variables_make_the_rank():
    outer = detect_outer_launcher(SRUN)
    assert outer is not None and outer.launcher == "srun"
    assert (outer.rank, outer.world_size, outer.local_rank, outer.local_world_size) == (4, 5, 0, 1)
    assert (outer.node_rank, outer.num_nodes, outer.master_addr, outer.master_port) == (2, 3, "gpu07", 29500)
    assert outer.hosts() == {"node0": [0, 1], "node1": [0, 1], "localhost": [0]}  # this node is the third
    env = outer.environment()  # what torch.distributed's env:// rendezvous reads
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("4", "5", "0", "gpu07")


def test_open_mpi_variables_make_the_rank():
    outer = detect_outer_launcher(MPIRUN)
    assert outer is not None and outer.launcher == "mpirun"
    assert (outer.rank, outer.world_size, outer.local_rank, outer.local_world_size) == (2, 4, 0, 2)
    assert (outer.node_rank, outer.num_nodes, outer.master_addr) == (1, 2, "node-a")


def test_no_outer_launcher_without_a_rank():
    assert detect_outer_launcher({}) is None
    # inside a Slurm allocation or its batch script, but not a task of an srun step
    allocation = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    assert detect_outer_launcher(allocation) is None
    assert detect_outer_launcher({**SRUN, "SLURM_STEP_ID": str(0xFFFFFFFB)}) is None  # the batch step
    # RANK alone (a user's shell) is not torch elastic's
    assert detect_outer_launcher({"RANK": "0", "WORLD_SIZE": "2"}) is None


def test_torchrun_started_under_srun_is_torchruns_rank():
    outer = detect_outer_launcher({**SRUN, **TORCHRUN})
    assert outer is not None and outer.launcher == "torchrun" and outer.rank == 3


def test_slurm_lists():
    assert slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm_tasks_per_node("4") == [4]
    assert slurm_first_host("node[03-05,9],gpu1") == "node03"
    assert slurm_first_host("login1,login2") == "login1"


def test_a_job_over_nodes_without_a_rendezvous_address_is_refused():
    outer = detect_outer_launcher({k: v for k, v in MPIRUN.items() if k != "MASTER_ADDR"})
    problems = launcher_conflicts({}, outer)
    assert [p.path for p in problems] == ["MASTER_ADDR"] and "export MASTER_ADDR" in str(problems[0])


def test_agreeing_keys_are_accepted():
    outer = detect_outer_launcher(TORCHRUN)
    local_recipe = {"runner": "local", "num_procs": 2, "num_nodes": None, "hostfile": None, "master_addr": "127.0.0.1",
                    "master_port": None, "node_rank": None, "launcher_args": "", "bind_cores_to_rank": False,
                    "max_restarts": 0, "log_dir": None}
    assert launcher_conflicts(local_recipe, outer) == []
    assert launcher_conflicts({"runner": "no_ssh", "num_nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1",
                               "master_port": 29400}, outer) == []
    plan = plan_from_mapping(local_recipe, "dsrun.worker", module=True, outer=outer)
    assert plan.world_size == 4 and plan.commands == [] and plan.hosts == {"node0": [0, 1], "localhost": [0, 1]}
    assert describe_world(plan) == "torchrun: WORLD_SIZE=4 (2 per node on 2 node(s))"


@pytest.mark.parametrize("key, value, says", [
    ("num_procs", 4, "launcher.num_procs: is 4, but torchrun started 2 rank(s) per node (LOCAL_WORLD_SIZE=2) "
                     "(set launcher.num_procs=2 or change the torchrun command)"),
    ("num_nodes", 3, "launcher.num_nodes: is 3, but torchrun started 2 node(s) (GROUP_WORLD_SIZE=2)"),
    ("node_rank", 0, "launcher.node_rank: is 0, but torchrun started 1 as this node's index (GROUP_RANK=1)"),
    ("hostfile", "hostfile", "launcher.hostfile: is 'hostfile', which only dsrun's own launcher acts on, but "
                             "torchrun started this rank (the outer launcher chose the nodes; set launcher.hostfile=null)"),
    ("runner", "ssh", "launcher.runner: is 'ssh', but torchrun already started this rank"),
    ("master_addr", "10.9.9.9", "launcher.master_addr: is '10.9.9.9', but torchrun meets at 10.0.0.1 (MASTER_ADDR=10.0.0.1)"),
    ("master_port", 29500, "launcher.master_port: is 29500, but torchrun meets at port 29400 (MASTER_PORT=29400)"),
    ("elastic_training", True, "(elasticity is the outer launcher's (torchrun --nnodes MIN:MAX))"),
    ("max_restarts", 3, "(restarts are the outer launcher's (torchrun --max-restarts))"),
])
def test_conflicting_keys_are_refused_one_line_each(key, value, says):
    outer = detect_outer_launcher(TORCHRUN)
    problems = launcher_conflicts({"runner": "local", "num_procs": 2, key: value}, outer)
    assert len(problems) == 1 and problems[0].path == f"launcher.{key}"
    assert says in str(problems[0]) and "\n" not in str(problems[0])
    with pytest.raises(UserError) as raised:
        plan_from_mapping({"num_procs": 2, key: value}, "dsrun.worker", module=True, outer=outer)
    assert [p.path for p in raised.value.problems] == [f"launcher.{key}"]


def test_the_matching_runner_agrees_with_each_launcher():
    assert launcher_conflicts({"runner": "slurm", "num_procs": 1}, detect_outer_launcher(SRUN)) == []
    assert launcher_conflicts({"runner": "openmpi", "num_procs": 2}, detect_outer_launcher(MPIRUN)) == []
    (problem,) = launcher_conflicts({"runner": "slurm", "num_procs": 2}, detect_outer_launcher(MPIRUN))
    assert problem.path == "launcher.runner" and "mpirun already started this rank" in problem.message


def test_dsrun_launch_flags_are_checked_and_the_script_is_the_rank():
    from dsrun.launcher.options import LaunchOptions
    from dsrun.launcher.outer import launch_conflicts, rank_argv

    outer = detect_outer_launcher(TORCHRUN)
    agreeing = LaunchOptions(target="train.py", target_args=["--lr", "0.1"], num_procs=2, python="python")
    assert launch_conflicts(agreeing, outer) == []
    assert rank_argv(agreeing, outer) == ["python", "train.py", "--lr", "0.1", "--local_rank=1"]
    module = LaunchOptions(target="pkg.train", module=True, no_local_rank=True, python="python")
    assert rank_argv(module, outer) == ["python", "-m", "pkg.train"]
    refused = LaunchOptions(target="train.py", num_procs=4, hostfile="hosts", runner="pdsh")
    assert [str(p) for p in launch_conflicts(refused, outer)] == [
        "--launcher: is 'pdsh', but torchrun already started this rank (drop --launcher: under torchrun, dsrun "
        "starts no ranks)",
        "--num_procs: is 4, but torchrun started 2 rank(s) per node (LOCAL_WORLD_SIZE=2) (set --num_procs 2 or "
        "change the torchrun command)",
        "--hostfile: is 'hosts', which only dsrun's own launcher acts on, but torchrun started this rank (the outer "
        "launcher chose the nodes; drop --hostfile)"]
