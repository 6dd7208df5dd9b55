"""``dsrun export-job`` as users run it (in-process): a recipe becomes a manifest that validates against its
resource's schema, or an sbatch script bash accepts; bad input is one line and exit code 2."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from dsrun.cli.__main__ import main
from tests.unit.launcher.k8s_schema import manifest_problems

WORLD = ["launcher.num_nodes=2", "launcher.num_procs=2", "train.save_interval=5"]
RUN_DIR = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"


def export(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["export-job", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob", "jobset"])
def test_a_recipe_becomes_a_manifest_valid_against_its_schema(target, capsys):
    code, out, err = export(capsys, "--target", target, "--image", "reg/dsrun:1", "--pvc", "runs", *WORLD)
    assert code == 0, err
    doc = yaml.safe_load(out)
    assert manifest_problems(doc) == []
    assert doc["metadata"]["name"] == "dsrun-train"
    text = out.lower()
    assert "ssh" not in text
    assert ("- torchrun\n" in out and "- --nnodes\n" in out and "- train.resume=auto\n" in out
            and f"hydra.run.dir=/runs/{RUN_DIR}" in out)


def test_sbatch_script_to_a_file(tmp_path, capsys):
    path = tmp_path / "job.sh"
    code, out, err = export(capsys, "--target", "sbatch", "--runs-dir", "/shared/runs", "--time", "01:00:00",
                            "-o", str(path), *WORLD, "launcher.master_port=29555")
    assert code == 0, err
    assert out == "" and f"wrote {path}; submit it with: sbatch {path}" in err
    script = path.read_text()
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, timeout=30).returncode == 0
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    assert "export MASTER_PORT=29555" in script.splitlines()  # the recipe's port is the one srun's ranks meet at
    # every task runs in the run directory the batch shell fixed, named as Hydra names its own
    assert "export DSRUN_RUN_DIR=/shared/runs/outputs/$(date +%Y-%m-%d/%H-%M-%S)" in script.splitlines()
    assert '"hydra.run.dir=$DSRUN_RUN_DIR" train.resume=auto &' in script


@pytest.mark.parametrize("args, line", [
    (["--target", "k8s", "--image", "x"], "error: --target: unknown target 'k8s'; expected one of pytorchjob, "
                                          "trainjob, jobset, sbatch"),
    (["--target", "jobset"], "error: --image: is missing; every pod of --target jobset runs it"),
    (["--target", "sbatch", "--pvc", "runs"], "error: --pvc: is not read by --target sbatch"),
    (["--target", "pytorchjob", "--image", "x", "--time", "1:00:00"],
     "error: --time: is not read by --target pytorchjob"),
    (["--target", "trainjob", "--image", "x", "--max-restarts", "5"], "error: --max-restarts: is not read by "
                                                                      "--target trainjob"),
    (["--target", "sbatch", "--runs-dir", "runs"], "error: --runs-dir: is 'runs', a relative path"),
    (["--target", "sbatch", "--grace-period", "60"], "error: --grace-period: is not read by --target sbatch"),
    (["--target", "pytorchjob", "--image", "x", "--grace-period", "60"],
     "error: --grace-period: is 60 s, but the ranks may take train.preemption.grace_s=120 s to save and torchrun "
     "waits 10 s more (give at least 140, or lower train.preemption.grace_s)"),
    (["--target", "trainjob", "--image", "x", "--name", "My_Job"], "error: --name: 'My_Job' is not a name"),
    (["--target", "sbatch", "train.resume=/ckpt"], "error: train.resume: is /ckpt, but the exported job resumes"),
    (["--target", "sbatch", "hydra.run.dir=/x"], "error: hydra.run.dir: is set, but each run of the exported job"),
])
def test_bad_options_are_one_line_and_exit_2(args, line, capsys):
    code, out, err = export(capsys, *args)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(line), err


@pytest.mark.parametrize("args, starts", [
    (["--target", "jobset", "--image", "x", "launcher.hostfile=hosts"], ["error: launcher.hostfile: is 'hosts'"]),
    (["--target", "sbatch", "launcher=ssh"], ["error: launcher.runner: is 'ssh'", "error: launcher.hostfile:"]),
    (["--target", "pytorchjob", "--image", "x", "launcher.master_port=29500"],
     ["error: launcher.master_port: is 29500, but torchrun meets at port 23456 (PET_MASTER_PORT=23456)"]),
    (["--target", "jobset", "--image", "x", "--gpus", "4"], ["error: --gpus: is 4, but the recipe starts 2 rank(s)"]),
    (["--target", "pytorchjob", "--image", "x", *WORLD], ["error: --pvc: is missing, but the job spans 2 pods"]),
])
def test_a_recipe_the_job_cannot_run_is_refused(args, starts, capsys):
    code, out, err = export(capsys, *args)
    assert (code, out) == (2, "")
    lines = err.splitlines()
    assert len(lines) == len(starts) and all(a.startswith(b) for a, b in zip(lines, starts)), err
