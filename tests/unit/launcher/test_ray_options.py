"""``launcher=ray``'s keys (dsrun/launcher/ray_options.py): the config group's typed defaults, the plan of a Ray
Train job, and the keys the ray launcher does not read refused one line each, with its own keys named.
(The job itself on a real Ray: tests/integration/launcher/test_ray.py.)"""
from __future__ import annotations

import pytest

from dsrun.launcher import launch_from_mapping, plan_from_mapping
from dsrun.launcher.outer import detect_outer_launcher
from dsrun.launcher.ray_options import RayOptions
from dsrun.utils.errors import UserError


def problems(mapping: dict, **kwargs) -> list[str]:
    with pytest.raises(UserError) as caught:
        plan_from_mapping(mapping, "dsrun.worker", module=True, **kwargs)
    return [str(problem) for problem in caught.value.problems]


def test_the_ray_group_plans_its_workers_with_typed_defaults():
    from dsrun.compose import compose_runspec
    from dsrun.runspec import resolve_run

    resolved = resolve_run(compose_runspec(["launcher=ray", "launcher.num_procs=3", "launcher.max_failures=2",
                                            "launcher.resources_per_worker={CPU: 1.5}"]))
    assert resolved.plan.ray == RayOptions(num_procs=3, resources_per_worker={"CPU": 1.5}, max_failures=2)
    assert resolved.plan.ray.max_preemption_failures == -1  # Ray's default: a drain restarts the group each time
    assert resolved.plan.ray.local_cpus() == 5  # 3 workers x 1.5 CPUs, rounded up
    assert resolved.world_size == 3 and resolved.plan.hosts == {"localhost": [0, 1, 2]}
    assert resolved.world_size_source == "launcher=ray: launcher.num_procs=3 Ray Train workers"
    on_a_cluster = plan_from_mapping({"runner": "ray", "num_procs": 2, "address": "auto"}, "dsrun.worker")
    assert on_a_cluster.hosts == {"ray": [0, 1]}  # not this machine: its memory is not the workers'


def test_keys_the_ray_launcher_does_not_read_are_refused_one_line_each():
    assert problems({"runner": "ray", "hostfile": "hosts", "max_failure": 2, "num_procs": "two",
                     "max_failures": -2, "max_preemption_failures": -3, "resources_per_worker": {"CPU": -1}}) == [
        "launcher.hostfile: is not read by the ray launcher (Ray starts the ranks) (its keys: runner, num_procs, "
        "resources_per_worker, use_gpu, max_failures, max_preemption_failures, address, storage_path, num_cpus)",
        "launcher.max_failure: is not read by the ray launcher (Ray starts the ranks) (did you mean "
        "'max_failures'?)",
        "launcher.num_procs: must be int, got 'two'",
        "launcher.max_failures: must be -1 (no limit) or more, got -2",
        "launcher.max_preemption_failures: must be -1 (no limit) or more, got -3",
        "launcher.resources_per_worker.CPU: must be a number 0 or more, got -1"]


def test_ray_is_not_dsruns_launcher_nor_a_rank_of_torchrun():
    with pytest.raises(UserError, match="is 'ray': Ray Train starts the ranks"):
        launch_from_mapping({"runner": "ray"}, "dsrun.worker", module=True)
    outer = detect_outer_launcher({"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "WORLD_SIZE": "2"})
    assert problems({"runner": "ray"}, outer=outer) == [
        "launcher.runner: is 'ray', but torchrun already started this rank (RANK=0) (drop launcher=ray under "
        "torchrun, or run dsrun train launcher=ray outside it)"]


def test_prepare_run_writes_the_run_for_your_own_trainer_and_leaves_the_launcher_to_it(tmp_path):
    from omegaconf import OmegaConf

    import dsrun.ray

    config = dsrun.ray.prepare_run(["train.max_steps=7"], num_workers=3, run_dir=tmp_path / "run")
    assert config == {"run_dir": str((tmp_path / "run").resolve())}
    written = OmegaConf.load(tmp_path / "run" / "resolved.yaml")
    assert (written.launcher.runner, written.launcher.num_procs, written.train.max_steps) == ("ray", 3, 7)
    with pytest.raises(UserError) as caught:
        dsrun.ray.prepare_run(["launcher.num_procs=4", "+launcher.max_failures=1"], num_workers=2, run_dir=tmp_path)
    assert [problem.path for problem in caught.value.problems] == ["launcher.num_procs", "launcher.max_failures"]


def test_the_failure_limits_reach_rays_failure_config_and_a_ray_without_preemption_restarts_refuses_one(
        monkeypatch, tmp_path):
    """``dsrun.ray.fit`` builds the trainer with both limits (Ray is not started: the trainer is a stand-in); a
    Ray whose ``FailureConfig`` has no ``max_preemption_failures`` refuses a limit set for it in one line, before
    it starts, and is asked nothing at the default."""
    import ray
    import ray.train
    import ray.train.torch

    import dsrun.ray

    built = {}

    class Trainer:
        def __init__(self, loop, train_loop_config, scaling_config, run_config):
            built["failure_config"] = run_config.failure_config

        def fit(self):
            return "fitted"

    monkeypatch.setattr(ray.train.torch, "TorchTrainer", Trainer)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # as under a driver that joined a cluster already
    assert dsrun.ray.fit(tmp_path, RayOptions(max_failures=1, max_preemption_failures=3)) == "fitted"
    assert (built["failure_config"].max_failures, built["failure_config"].max_preemption_failures) == (1, 3)

    real = ray.train.FailureConfig

    def failure_config_without_preemption(max_failures: int = 0):  # an older Ray's signature
        return real(max_failures=max_failures)

    monkeypatch.setattr(ray.train, "FailureConfig", failure_config_without_preemption)
    built.clear()
    with pytest.raises(UserError) as caught:
        dsrun.ray.fit(tmp_path, RayOptions(max_preemption_failures=3))
    assert [str(problem) for problem in caught.value.problems] == [
        f"launcher.max_preemption_failures: is 3, but Ray {ray.__version__} has no preemption restarts "
        "(FailureConfig.max_preemption_failures) (upgrade Ray, or leave it at -1)"]
    assert not built
    assert dsrun.ray.fit(tmp_path, RayOptions(max_failures=2)) == "fitted"
    assert (built["failure_config"].max_failures, built["failure_config"].max_preemption_failures) == (2, -1)
