"""The manifests and the batch script ``dsrun export-job`` writes (dsrun/launcher/kubernetes.py, sbatch.py): each
kind valid against its resource's schema (the SDK models, tests/unit/launcher/k8s_schema.py), a wrong one not,
no ssh anywhere, the torchrun contract in every pod, and the batch script's stop-and-requeue on Slurm's signal."""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from dsrun.launcher.cluster_job import ClusterJob, NodeResources, default_name, name_problems, train_args
from dsrun.launcher.kubernetes import TARGETS, manifest
from dsrun.launcher.sbatch import batch_script
from tests.unit.launcher.k8s_schema import manifest_problems

OVERRIDES = ["+recipe=gpt_zero3", "train.save_interval=50"]
API = {"pytorchjob": ("kubeflow.org/v1", "PyTorchJob"), "trainjob": ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
       "jobset": ("jobset.x-k8s.io/v1alpha2", "JobSet")}


def two_nodes(**changes) -> ClusterJob:
    job = ClusterJob(name="gpt-zero3", nodes=2, procs_per_node=4, train_args=train_args(OVERRIDES, [], "/runs"),
                     runs_dir="/runs", resources=NodeResources(cpus="16", memory="64Gi", gpus=4), image="reg/dsrun:1",
                     namespace="ml", pvc="dsrun-runs")
    return dataclasses.replace(job, **changes)


def pod_spec(target: str, doc: dict) -> dict:
    """The pod (or, for a TrainJob, the runtime patch of the pod) of ``doc``."""
    if target == "pytorchjob":
        return doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    if target == "jobset":
        return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    patch = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    return patch["template"]["spec"]["template"]["spec"]


def command(target: str, doc: dict) -> list[str]:
    if target == "trainjob":
        return doc["spec"]["trainer"]["command"]
    return pod_spec(target, doc)["containers"][0]["command"]


@pytest.mark.parametrize("target", TARGETS)
def test_each_manifest_is_valid_against_its_schema_and_runs_the_torchrun_contract(target):
    doc = manifest(target, two_nodes())
    text = yaml.safe_dump(doc, sort_keys=False)
    assert manifest_problems(yaml.safe_load(text)) == []  # what kubectl apply reads back
    assert (doc["apiVersion"], doc["kind"]) == API[target]
    assert doc["metadata"]["name"] == "gpt-zero3" and doc["metadata"]["namespace"] == "ml"
    assert "ssh" not in text.lower()
    assert command(target, doc) == ["torchrun", "--nnodes", "2", "--nproc-per-node", "4",
                                    "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                                    "--shutdown-timeout", "130", "-m", "dsrun", "train",
                                    *OVERRIDES, "hydra.run.dir=/runs/outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}",
                                    "train.resume=auto"]
    pod = pod_spec(target, doc)
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "dsrun-runs"}} in pod["volumes"]
    assert pod["terminationGracePeriodSeconds"] == 140  # the ranks' 120 s, torchrun's 10 s more, the pod's 10 s
    assert {"name": "runs", "mountPath": "/runs"} in pod["containers"][0]["volumeMounts"]
    env = doc["spec"]["trainer"]["env"] if target == "trainjob" else pod["containers"][0]["env"]
    assert {"name": "MLFLOW_TRACKING_URI", "value": "sqlite:////runs/mlruns/mlflow.db"} in env  # on the volume


def test_replicas_resources_and_restarts_per_kind():
    pytorchjob, trainjob, jobset = (manifest(t, two_nodes()) for t in TARGETS)
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 1)
    assert replicas["Worker"]["restartPolicy"] == "OnFailure" and pytorchjob["spec"]["runPolicy"]["backoffLimit"] == 3
    assert pytorchjob["spec"]["nprocPerNode"] == "4"
    resources = replicas["Master"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "16", "memory": "64Gi"},
                         "limits": {"memory": "64Gi", "nvidia.com/gpu": "4"}}
    trainer = trainjob["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["resourcesPerNode"]) == (2, 4, resources)
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3 and jobset["spec"]["network"]["enableDNSHostnames"]
    env = {e["name"]: e for e in job["template"]["spec"]["containers"][0]["env"]}
    assert env["PET_MASTER_ADDR"]["value"] == "gpt-zero3-node-0-0.gpt-zero3"  # the headless service's host name
    assert "job-completion-index" in env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]


def test_one_node_has_no_workers_and_without_a_claim_an_emptydir():
    doc = manifest("pytorchjob", two_nodes(nodes=1, pvc=None, resources=NodeResources()))
    assert list(doc["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    pod = pod_spec("pytorchjob", doc)
    assert {"name": "runs", "emptyDir": {}} in pod["volumes"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "4"}}  # a CPU per rank
    assert manifest_problems(doc) == []


def _misspelt(target: str, doc: dict) -> None:
    claim = pod_spec(target, doc)["volumes"][0]["persistentVolumeClaim"]
    claim["claimname"] = claim.pop("claimName")


def _wrong_type(target: str, doc: dict) -> None:
    pod_spec(target, doc)["terminationGracePeriodSeconds"] = "120"


def _missing(target: str, doc: dict) -> None:
    del pod_spec(target, doc)["containers"][0]["name"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("break_it, where", [(_misspelt, "claimname"), (_wrong_type, "terminationGracePeriodSeconds"),
                                             (_missing, "name")])
def test_a_wrong_manifest_fails_its_schema(target, break_it, where):
    doc = copy.deepcopy(manifest(target, two_nodes()))
    break_it(target, doc)
    problems = manifest_problems(doc)
    assert problems and any(where in p for p in problems), problems


def test_a_wrong_kind_or_top_level_field_fails():
    doc = manifest("trainjob", two_nodes())
    assert manifest_problems({**doc, "kind": "TrainJobs"})
    assert any("runtimeref" in p for p in manifest_problems({**doc, "spec": {**doc["spec"], "runtimeref": {}}}))
    doc = manifest("jobset", two_nodes())
    doc["spec"]["replicatedJobs"][0]["replicas"] = "1"
    assert manifest_problems(doc)


def test_names():
    assert default_name(["+recipe=gpt_zero3", "zero=stage2"]) == "dsrun-gpt-zero3"
    assert default_name([]) == "dsrun-train"
    assert name_problems("gpt-zero3") == []
    assert name_problems("GPT_zero3") and name_problems("x" * 41) and name_problems("-a")


def test_the_batch_script_is_valid_bash_with_one_task_per_rank(tmp_path):
    # the batch shell names each run's directory itself (dsrun export-job gives sbatch no hydra.run.dir)
    job = two_nodes(runs_dir="/shared/runs", train_args=train_args(OVERRIDES, ["/shared/recipes"], None),
                    resources=NodeResources(cpus="4", memory="64G", gpus=4), time="04:00:00", partition="gpu")
    script = batch_script(job)
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, timeout=30).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --mem=64G", "#SBATCH --time=04:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --signal=B:USR1@150", "#SBATCH --requeue"):
        assert line in script.splitlines()
    assert ("srun --ntasks-per-node=4 --kill-on-bad-exit=1 python -m dsrun train --recipes-dir /shared/recipes "
            '+recipe=gpt_zero3 train.save_interval=50 "hydra.run.dir=$DSRUN_RUN_DIR" train.resume=auto &') in script
    # one run directory for every task, fixed before srun starts them: they meet in it on a port the system gives
    # rank 0's store, none derived from the job id (another job on the node may hold that one)
    assert "export DSRUN_RUN_DIR=/shared/runs/outputs/$(date +%Y-%m-%d/%H-%M-%S)" in script.splitlines()
    assert "MASTER_PORT" not in script and "SLURM_JOB_ID %" not in script
    assert "export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:////shared/runs/mlruns/mlflow.db}" in script
    assert "ssh" not in script.lower()


def test_the_batch_script_stops_the_ranks_then_requeues_on_usr1(tmp_path):
    """Slurm's --signal=B:USR1 reaches the batch shell: the step gets SIGTERM, is waited for, then the job is
    requeued. srun and scontrol are stand-ins that log what they were asked."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/bash\ntrap 'echo srun got TERM >> {log}; exit 143' TERM\n"
                                  f"echo srun \"$@\" >> {log}\nwhile true; do sleep 0.05; done\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho scontrol \"$@\" >> {log}\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(batch_script(two_nodes(nodes=1, procs_per_node=2, runs_dir=None,
                                             train_args=train_args(OVERRIDES, [], None))))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    shell = subprocess.Popen(["bash", str(script)], env=env)
    try:
        deadline = time.monotonic() + 20
        while not (log.exists() and "srun" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        shell.send_signal(signal.SIGUSR1)
        assert shell.wait(timeout=20) == 0
    finally:
        shell.kill()
    calls = log.read_text().splitlines()
    assert calls[0].startswith("srun --ntasks-per-node=2 --kill-on-bad-exit=1 python -m dsrun train +recipe=gpt_zero3")
    # the batch shell gave every task the same run directory, named as Hydra names its own
    assert re.search(r" hydra\.run\.dir=outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d train\.resume=auto$", calls[0]), calls[0]
    assert calls[1:] == ["srun got TERM", "scontrol requeue 4242"]
