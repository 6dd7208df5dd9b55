"""Kubernetes manifests that run a :class:`~dsrun.launcher.cluster_job.ClusterJob` without ssh: every pod runs
``torchrun --nnodes N --nproc-per-node P -m dsrun train OVERRIDES train.resume=auto`` and each rank torchrun starts
becomes that rank of ``dsrun train`` (:mod:`dsrun.launcher.outer`). docs/kubernetes.md.

Three kinds, one pod:

* ``pytorchjob`` — Kubeflow's training operator, ``kubeflow.org/v1`` ``PyTorchJob``: a ``Master`` replica and
  ``N - 1`` ``Worker`` replicas in a container named ``pytorch``; the operator gives each pod ``PET_NODE_RANK``,
  ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` (the master's service), which torchrun reads.
* ``trainjob`` — Kubeflow Trainer, ``trainer.kubeflow.org/v1alpha1`` ``TrainJob`` on the ``torch-distributed``
  runtime, which sets the same ``PET_*`` variables in its ``node`` container; the run directories' volume and the
  grace period reach that container through a runtime patch.
* ``jobset`` — ``jobset.x-k8s.io/v1alpha2`` ``JobSet``: one indexed Job of ``N`` pods, its headless service
  (``network.enableDNSHostnames``) giving node 0 the name ``NAME-node-0-0.NAME``; the pod sets the ``PET_*``
  variables itself from its completion index.

Every pod mounts the run directories' volume (a PersistentVolumeClaim, ``--pvc``; else an ``emptyDir`` that lives
as long as the pod) at :data:`RUNS_MOUNT` (the local MLflow store too: ``MLFLOW_TRACKING_URI``) and a
memory-backed ``/dev/shm``, and has ``grace_period_s`` between
SIGTERM and SIGKILL: on SIGTERM the ranks stop at a step boundary and save a checkpoint (with
``train.save_interval``), and the restarted job (``restartPolicy``, ``backoffLimit``, JobSet's
``failurePolicy.maxRestarts``) resumes from it through ``train.resume=auto``.
"""
from __future__ import annotations

from typing import Any

from dsrun.launcher.cluster_job import RENDEZVOUS_PORT, ClusterJob

TARGETS = ("pytorchjob", "trainjob", "jobset")
RUNS_MOUNT = "/runs"                   # where the run directories' volume is mounted in every pod
TRAINJOB_RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime that starts torchrun
TRAINJOB_NODE = "node"                 # that runtime's replicated job and container
# where each kind's rendezvous listens (the PET_MASTER_PORT its pods get): the training operator's default port,
# Kubeflow Trainer's torch runtime's, and the JobSet's own (torchrun's default)
MASTER_PORTS = {"pytorchjob": 23456, "trainjob": 29400, "jobset": RENDEZVOUS_PORT}
JOBSET_NODE = "node"                   # the JobSet's replicated job: its pods are NAME-node-0-<index>
_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def manifest(target: str, job: ClusterJob) -> dict[str, Any]:
    """The manifest of ``target`` (one of :data:`TARGETS`) for ``job``, as a mapping ready for YAML."""
    return {"pytorchjob": pytorchjob, "trainjob": trainjob, "jobset": jobset}[target](job)


def _metadata(job: ClusterJob) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": job.name,
                            "labels": {"app.kubernetes.io/name": job.name, "app.kubernetes.io/created-by": "dsrun"}}
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def _resources(job: ClusterJob) -> dict[str, Any]:
    """One pod's requests and limits: CPUs and memory as asked (at least a CPU per rank), a GPU per rank."""
    res = job.resources
    requests = {"cpu": res.cpus or str(job.procs_per_node), **({"memory": res.memory} if res.memory else {})}
    limits = {**({"memory": res.memory} if res.memory else {}),
              **({"nvidia.com/gpu": str(res.gpus)} if res.gpus else {})}
    return {"requests": requests, **({"limits": limits} if limits else {})}


def _volumes(job: ClusterJob) -> list[dict[str, Any]]:
    runs = ({"persistentVolumeClaim": {"claimName": job.pvc}} if job.pvc else {"emptyDir": {}})
    return [{"name": "runs", **runs}, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]


def _mounts() -> list[dict[str, Any]]:
    return [{"name": "runs", "mountPath": RUNS_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}]


def _env(job: ClusterJob, extra: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    store = job.mlflow_store()
    return [{"name": "PYTHONUNBUFFERED", "value": "1"},
            *([{"name": "MLFLOW_TRACKING_URI", "value": store}] if store else []), *(extra or [])]


def _container(job: ClusterJob, name: str, env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"name": name, "image": job.image, "command": job.torchrun_argv(), "env": _env(job, env),
            "resources": _resources(job), "volumeMounts": _mounts()}


def _pod(job: ClusterJob, container: dict[str, Any], restart_policy: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [container], "volumes": _volumes(job),
                            "terminationGracePeriodSeconds": job.grace_period_s}
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    return {"metadata": {"labels": {"app.kubernetes.io/name": job.name}}, "spec": spec}


def pytorchjob(job: ClusterJob) -> dict[str, Any]:
    """Kubeflow's ``PyTorchJob``: the operator restarts a failed pod in place (``OnFailure``) up to
    ``backoffLimit`` times and recreates a deleted (preempted) one."""

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": _pod(job, _container(job, "pytorch"))}

    specs = {"Master": replicas(1), **({"Worker": replicas(job.nodes - 1)} if job.nodes > 1 else {})}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _metadata(job),
            "spec": {"nprocPerNode": str(job.procs_per_node), "pytorchReplicaSpecs": specs,
                     "runPolicy": {"backoffLimit": job.max_restarts, "cleanPodPolicy": "None"}}}


def trainjob(job: ClusterJob) -> dict[str, Any]:
    """Kubeflow Trainer's ``TrainJob`` on the ``torch-distributed`` runtime (its restarts are the runtime's)."""
    pod_patch = {"volumes": _volumes(job), "terminationGracePeriodSeconds": job.grace_period_s,
                 "containers": [{"name": TRAINJOB_NODE, "volumeMounts": _mounts()}]}
    patch = {"manager": "dsrun", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": TRAINJOB_NODE, "template": {"spec": {"template": {"spec": pod_patch}}}}]}}}}
    trainer = {"image": job.image, "command": job.torchrun_argv(), "env": _env(job), "numNodes": job.nodes,
               "numProcPerNode": job.procs_per_node, "resourcesPerNode": _resources(job)}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(job),
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                    "name": TRAINJOB_RUNTIME},
                     "trainer": trainer, "runtimePatches": [patch]}}


def jobset(job: ClusterJob) -> dict[str, Any]:
    """A ``JobSet`` of one indexed Job: a failed pod fails the Job, and JobSet recreates every pod, up to
    ``failurePolicy.maxRestarts`` times, so the ranks meet afresh at node 0."""
    rendezvous = [
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": _COMPLETION_INDEX}}},
        {"name": "PET_MASTER_ADDR", "value": f"{job.name}-{JOBSET_NODE}-0-0.{job.name}"},
        {"name": "PET_MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
    ]
    pod = _pod(job, _container(job, "dsrun", rendezvous), restart_policy="Never")
    template = {"spec": {"parallelism": job.nodes, "completions": job.nodes, "completionMode": "Indexed",
                         "backoffLimit": 0, "template": pod}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(job),
            "spec": {"network": {"enableDNSHostnames": True},
                     "failurePolicy": {"maxRestarts": job.max_restarts},
                     "replicatedJobs": [{"name": JOBSET_NODE, "replicas": 1, "template": template}]}}
