"""dsrun's side of ``hydra/launcher=submitit_slurm|submitit_local`` (dsrun/launcher/slurm_jobs.py,
dsrun/cli/submitted.py), in-process: the launcher the overrides pick, dsrun's settings of it (the user's own keys
win), the batch parameters it adds (SIGUSR1 as the notice, requeue), "Slurm not reachable" with no Slurm client on
PATH, the job id ``scontrol requeue`` takes, when a stopped job is requeued, and how a job's tasks meet (every wait
bounded, a task that stopped before named to the others in one line, a requeued run apart from its first). The
real Slurm: tests/e2e/slurm."""
from __future__ import annotations

import threading

import pytest

from dsrun.cli.submitted import JobPlace
from dsrun.launcher.outer import detect_outer_launcher, launcher_conflicts
from dsrun.launcher.slurm_jobs import (JobStopped, TaskRendezvous, TasksApart, batch_rendezvous, batch_settings,
                                       job_rank, launcher_choice, launcher_overrides, slurm_job_id, unreachable)


def test_the_launcher_choice_is_the_last_hydra_launcher_override():
    assert launcher_choice(["zero=stage1,stage2"]) is None
    picked = launcher_choice(["hydra/launcher=submitit_local", "x=1", "hydra/launcher=submitit_slurm"])
    assert picked == "submitit_slurm"


def test_slurm_settings_ask_one_task_per_rank_the_notice_before_the_ranks_grace_and_requeues():
    got = launcher_overrides("submitit_slurm", [], num_procs=2, num_nodes=None, grace_s=120.5)
    assert got == ["hydra.launcher._target_=hydra_plugins.dsrun_submitit._launcher.DsrunSlurmLauncher",
                   "hydra.launcher.tasks_per_node=2", "hydra.launcher.nodes=1", "hydra.launcher.signal_delay_s=151",
                   "hydra.launcher.max_num_timeout=3"]
    # the user's own settings win: dsrun adds none of the keys they set
    mine = launcher_overrides("submitit_slurm", ["hydra.launcher.nodes=2", "hydra.launcher.max_num_timeout=0"], 2, 2,
                              60)
    assert not any(o.startswith(("hydra.launcher.nodes=", "hydra.launcher.max_num_timeout=")) for o in mine)
    assert launcher_overrides("submitit_local", [], 2, None, 120) == [
        "hydra.launcher._target_=hydra_plugins.dsrun_submitit._launcher.DsrunLocalLauncher"]


def test_batch_settings_add_the_usr1_notice_and_requeue_before_the_users_setup():
    params = batch_settings({"signal_delay_s": 150, "setup": ["module load x"],
                             "additional_parameters": {"mail-type": "END"}})
    assert params["additional_parameters"] == {"mail-type": "END", "signal": "USR1@150", "requeue": True,
                                               "open_mode": "append"}
    # a requeued job's second run appends to the first run's logs (sbatch's and srun's), where Slurm would truncate
    assert params["srun_args"] == ["--open-mode=append"]
    # no MASTER_PORT: a port derived from the job's id may be taken on the node; rank 0 opens one (TaskRendezvous)
    assert params["setup"] == ["export SUBMITIT_PREEMPT_SIGNAL=USR1", "module load x"]
    # a signal the user asks for themselves is theirs
    assert batch_settings({"additional_parameters": {"signal": "B:USR1@300"}})["additional_parameters"]["signal"] == \
        "B:USR1@300"
    own = batch_settings({"additional_parameters": {"open_mode": "truncate"}, "srun_args": ["--open-mode=truncate"]})
    assert own["additional_parameters"]["open_mode"] == "truncate" and own["srun_args"] == ["--open-mode=truncate"]


def test_no_slurm_client_on_path_is_one_problem_naming_it_and_the_local_launcher(tmp_path):
    problem = unreachable({"PATH": str(tmp_path)})
    assert str(problem) == (
        "hydra/launcher=submitit_slurm: Slurm is not reachable: sbatch and scontrol not found on PATH (run dsrun on "
        "a Slurm login node (Debian: apt-get install slurm-client) or run the jobs on this machine with "
        "hydra/launcher=submitit_local)")


def test_the_requeued_id_of_an_array_task_is_the_arrays_with_the_task():
    assert slurm_job_id({"SLURM_JOB_ID": "17", "SLURM_ARRAY_JOB_ID": "15", "SLURM_ARRAY_TASK_ID": "1"}) == "15_1"
    assert slurm_job_id({"SLURM_JOB_ID": "17"}) == "17"


def test_an_srun_task_of_a_submitted_slurm_job_is_a_rank_and_a_local_job_is_not():
    task = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "1"}
    rank = job_rank(task)
    assert (rank.launcher, rank.rank, rank.world_size, rank.local_world_size) == ("srun", 1, 2, 2)
    assert job_rank({**task, "SUBMITIT_EXECUTOR": "local"}) is None
    assert job_rank({k: v for k, v in task.items() if k != "SUBMITIT_EXECUTOR"}) is None


def test_a_recipes_master_port_in_a_submitted_job_is_refused_naming_the_port_dsrun_picks():
    """The tasks of a submitted job meet on the port the system gives rank 0's store (TaskRendezvous), not 29500."""
    task = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "1"}
    (problem,) = launcher_conflicts({"master_port": 29555}, job_rank(task))
    assert str(problem) == (
        "launcher.master_port: is 29555, but the srun tasks of this job meet on a port the system gives rank 0's "
        "store as it binds (told to the other ranks through the run directory's .slurm_rendezvous/), so that no "
        "other job on the node holds it (drop launcher.master_port: dsrun picks the port itself)")
    assert "29500" not in str(problem)


def test_the_tasks_of_an_exported_batch_script_meet_in_the_run_directory_its_shell_fixed(tmp_path):
    task = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "1",
            "DSRUN_RUN_DIR": str(tmp_path / "outputs" / "2026-12-06" / "10-00-00")}
    rendezvous = batch_rendezvous(detect_outer_launcher(task), task)
    assert (rendezvous.rank, rendezvous.world_size) == (1, 2)
    assert rendezvous.folder == tmp_path / "outputs" / "2026-12-06" / "10-00-00" / ".slurm_rendezvous" / "job42.0-run0"
    # the recipe's launcher.master_port, which the script then exports, is where they meet instead; plain srun or
    # torchrun ranks meet as before
    assert batch_rendezvous(detect_outer_launcher(task), {**task, "MASTER_PORT": "29555"}) is None
    plain = {k: v for k, v in task.items() if k != "DSRUN_RUN_DIR"}
    assert batch_rendezvous(detect_outer_launcher(plain), plain) is None
    torchrun = {**task, "TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"}
    assert batch_rendezvous(detect_outer_launcher(torchrun), torchrun) is None


def test_a_stopped_slurm_job_is_requeued_until_its_requeues_are_spent(monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with pytest.raises(JobStopped) as stopped:
        JobPlace("slurm").stopped(138, max_requeues=3)
    assert stopped.value.exit_code == 138
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert JobPlace("slurm").stopped(138, max_requeues=3) == (
        "stopped (exit code 138); not requeued: hydra.launcher.max_num_timeout=3 requeues done")
    assert JobPlace("local").stopped(143, max_requeues=3) == (
        "stopped (exit code 143); not requeued: a local submitit job is not requeued")


def _rendezvous(tmp_path, rank, world_size=2, restarts="0", timeout_s=5.0) -> TaskRendezvous:
    environ = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": restarts}
    return TaskRendezvous(TaskRendezvous.for_run(tmp_path, rank, world_size, environ).folder, rank, world_size,
                          timeout_s=timeout_s, poll_s=0.01)


def test_the_tasks_of_a_job_meet_on_the_port_rank_0_opens_once_every_task_arrived(tmp_path):
    zero, one = _rendezvous(tmp_path, 0), _rendezvous(tmp_path, 1)
    got: dict[str, int] = {}
    follower = threading.Thread(target=lambda: (one.arrive(), got.update(port=one.port())))
    zero.arrive()
    follower.start()
    zero.open_port(31234)  # returns once rank 1 arrived
    follower.join(timeout=5)
    assert got == {"port": 31234}
    # the requeued job's run meets in a folder of its own: its first run's port is not read again
    again = _rendezvous(tmp_path, 1, restarts="1", timeout_s=0.05)
    assert again.folder != one.folder and again.folder.parent == one.folder.parent
    with pytest.raises(TasksApart, match="rank 0 did not open the port"):
        again.port()


def test_a_task_that_stopped_before_the_ranks_met_is_one_line_to_the_others_who_do_not_wait(tmp_path):
    zero, one = _rendezvous(tmp_path, 0, timeout_s=60), _rendezvous(tmp_path, 1, timeout_s=60)
    zero.fail("DistNetworkError: The server socket has failed to listen on any local network address.\n port 29502")
    with pytest.raises(TasksApart) as apart:
        one.port()  # at once, not after 60 s
    assert str(apart.value) == ("rank 1 of 2: rank 0 stopped before the ranks met: DistNetworkError: The server "
                                "socket has failed to listen on any local network address. port 29502")
    # and rank 0, waiting for a task that never came, stops after its timeout naming it
    late = _rendezvous(tmp_path / "other", 0, world_size=3, timeout_s=0.05)
    late.arrive()
    with pytest.raises(TasksApart, match=r"^rank 0 of 3: rank\(s\) 1, 2 did not reach the rendezvous within 0.05 s"):
        late.open_port(31234)
