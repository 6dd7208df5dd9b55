"""`dsrun train` end to end: the README's main job learns, every recipe runs, the loss curve is pinned.

The stored curve (tests/assets/default_recipe_curve.json) is the default recipe's first steps. A change
that moves it fails here; if the change is meant to, regenerate it knowingly with
``DSRUN_UPDATE_CURVES=1 python -m pytest tests/e2e/test_train.py -k curve`` and say so in the commit.
"""
import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dsrun.compose import list_recipes
from tests.helpers import REPO, free_port, run_cli

CURVE = REPO / "tests" / "assets" / "default_recipe_curve.json"
SHORT = ["train.max_steps=3", "train.eval_iters=1", "train.eval_interval=0", "data.max_bytes=300000"]


def train(tmp_path: Path, *overrides: str, timeout: float = 600) -> tuple[dict, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    result = run_cli("train", *overrides, f"launcher.master_port={free_port()}", cwd=tmp_path, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (metrics_path,) = tmp_path.glob("outputs/*/*/metrics.json")
    return json.loads(metrics_path.read_text()), metrics_path.parent


# The README's main job at a fifth of its budget: 60 of the default's 300 steps (the warm-up/cosine schedule spans
# the run's own steps), a checkpoint every 20 so that one is pruned (keep_last 2): the test's CPU 107 s -> 47 s.
# The learning bound below needs no more: eval 3.11 and 3.10 after 60 steps (seeds 1234 and 7) against 3.41
LEARN_STEPS, SAVE_EVERY = 60, 20


def context_free_floor(run_dir: Path) -> float:
    """The lowest eval loss (nats per token) any predictor that ignores context can reach on the run's own eval
    tokens: the empirical entropy of the targets the evaluation scores, H = -sum p ln p over their byte
    frequencies p (the cross-entropy of a fixed distribution q is H + KL(p || q) >= H, Gibbs' inequality). A loss
    below it proves the model predicts from the bytes before each target: it learned, whatever the machine."""
    import math
    from collections import Counter

    import hydra.utils

    spec = OmegaConf.load(run_dir / "resolved.yaml")
    corpus = hydra.utils.instantiate(spec.data, _convert_="all")  # as every rank builds it (dsrun.worker)
    ranks, batch = spec.launcher.num_procs, spec.ds.train_micro_batch_size_per_gpu
    counts: Counter = Counter()
    for rank in range(ranks):  # the batches each rank evaluates (dsrun/workloads/gpt.py: evaluate)
        for _, targets in corpus.eval_loader(batch, rank, ranks, max_batches=spec.train.eval_iters):
            counts.update(targets.flatten().tolist())
    total = sum(counts.values())
    return -sum(n / total * math.log(n / total) for n in counts.values())


@pytest.mark.slow
def test_default_recipe_learns(tmp_path):
    """The README's main-job command (a shorter budget, above): eval loss in nats per byte falls from ln(256) to
    below what any context-free predictor scores on the same eval bytes, and the closing lines say where its
    metrics, checkpoints and MLflow run went."""
    result = run_cli("train", f"train.max_steps={LEARN_STEPS}", f"train.save_interval={SAVE_EVERY}", cwd=tmp_path,
                     timeout=600, env={"DSRUN_MLFLOW": "true", "MLFLOW_TRACKING_URI": ""})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = tmp_path.glob("outputs/*/*")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    evals = [e["loss"] for e in metrics["eval_losses"]]
    assert metrics["eval_losses"][0]["step"] == 0 and evals[0] > 5.0  # ln(256) = 5.55 at initialisation
    floor = context_free_floor(run_dir)
    assert evals[-1] < floor, (evals, floor)
    assert metrics["eval_losses"][-1]["step"] == LEARN_STEPS
    assert len(metrics["train_losses"]) == metrics["steps"] == LEARN_STEPS
    assert metrics["world_size"] == 2 and metrics["tokens_per_second"] > 0
    check = run_cli("config", "--validate", str(run_dir / "ds_config.json"), "--world-size", "2")
    assert check.returncode == 0, check.stderr

    store = tmp_path / "mlruns" / "mlflow.db"
    where = run_dir.relative_to(tmp_path)  # the closing lines show paths below the current directory relative
    assert f"[dsrun] metrics: {where / 'metrics.json'}" in result.stdout
    assert f"[dsrun] checkpoints: {where / 'checkpoints'}" in result.stdout
    assert (f"[dsrun] mlflow: run '{run_dir.parent.name}/{run_dir.name}' (experiment 'dsrun') in mlruns/mlflow.db; "
            "browse: mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db") in result.stdout
    # a checkpoint every SAVE_EVERY steps, the last 2 kept (train.keep_last's default)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()) == [
        f"global_step{LEARN_STEPS - SAVE_EVERY}", f"global_step{LEARN_STEPS}"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("dsrun").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == f"{run_dir.parent.name}/{run_dir.name}"
    assert run.data.metrics["Eval/Samples/eval_loss"] == pytest.approx(evals[-1])


# Recipes another end-to-end test already trains with `dsrun train +recipe=NAME` as shipped (and checks more of):
# they are not run a second time here
TRAINED_ELSEWHERE = {
    "default": "test_default_recipe_learns, above",
    "gpt_xtc": "tests/e2e/test_compression_cli.py (it needs a teacher run first)",
    "gpt_qat": "tests/e2e/test_compression_cli.py",
    "gpt_data_efficiency": "tests/e2e/test_data_efficiency_recipe.py",
    "gpt_infinity": "tests/e2e/test_infinity_recipe.py",
    "gpt_tune": "tests/e2e/test_tune.py (every trial, and the final run)",
    "gpt_elastic": "tests/integration/launcher/test_elastic.py (over two hosts)",
    "gpt_pipe": "tests/e2e/test_dry_run_topology.py (a real 2-rank run, a smaller model; a non-finite loss fails it)",
    "gpt_moe": "tests/e2e/test_dry_run_topology.py (a real 2-rank run, a smaller model; a non-finite loss fails it)",
}


def validate_ds_config(path: Path, world_size: int) -> None:
    """What `dsrun config --validate PATH --world-size N` checks (tests/e2e/test_cli_config.py runs the command):
    the loading initialize does, which raises on any problem."""
    from dsrun.config import load_ds_config

    load_ds_config(str(path), world_size=world_size, world_size_source=f"--world-size {world_size}")


# fp16 matmuls on a CPU without fp16 arithmetic run at ~3 GFLOP/s (fp32: ~100): the fp16 recipe's brief run takes
# 16 times fewer tokens per step (its 3 steps: 17.5 s -> 1.3 s here), the same engine path
BRIEF_EXTRA = {"gpt_fp16": ["model.block_size=64", "ds.train_micro_batch_size_per_gpu=4"]}


def model_parallel(resolved: Path) -> int:
    """The ranks of a resolved recipe that hold one data-parallel replica: pipeline stages x AutoTP's ranks."""
    spec = OmegaConf.load(resolved)
    stages = spec.model.get("pipeline_stages", 1) or 1
    return stages * int(OmegaConf.select(spec, "ds.tensor_parallel.autotp_size", default=None) or 1)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(r for r in list_recipes() if r not in TRAINED_ELSEWHERE))
def test_every_recipe_runs_briefly(tmp_path, recipe):
    metrics, run_dir = train(tmp_path, f"+recipe={recipe}", *SHORT, *BRIEF_EXTRA.get(recipe, []))
    assert metrics["steps"] == 3 and all(loss == loss for loss in metrics["train_losses"])  # finite, not NaN
    # DeepSpeed checks the batch sizes against the data-parallel ranks: a pipeline's stages and AutoTP's
    # tensor-parallel ranks do not count
    validate_ds_config(run_dir / "ds_config.json", metrics["world_size"] // model_parallel(run_dir / "resolved.yaml"))


# gpt_elastic trains over the hosts of ./hostfile by SSH; on one machine it resolves with the local runner (still
# under the elastic agent): docs/elasticity.md
SINGLE_HOST = {"gpt_elastic": ["launcher.runner=local", "launcher.hostfile=null"]}


# gpt_xtc resolves only with a teacher run: tests/e2e/test_compression_cli.py trains one first
@pytest.mark.parametrize("recipe", sorted(r for r in list_recipes() if r != "gpt_xtc"))
def test_every_recipes_deepspeed_config_validates(tmp_path, recipe):
    """Every recipe, those trained elsewhere too: the DeepSpeed config it resolves to loads as initialize loads
    it, at the data-parallel world size the recipe launches."""
    from dsrun.compose import compose_runspec
    from dsrun.rundir import write_run_files
    from dsrun.runspec import resolve_run

    run = resolve_run(compose_runspec([f"+recipe={recipe}", *SINGLE_HOST.get(recipe, [])]))
    written = write_run_files(tmp_path, run)  # what `dsrun train` writes into the run directory
    validate_ds_config(written["ds_config"], run.world_size // model_parallel(written["resolved"]))


@pytest.mark.slow
def test_same_seed_same_curve_and_matches_stored_curve(tmp_path):
    overrides = ["train.max_steps=12", "train.eval_interval=0", "train.eval_iters=1"]
    first, _ = train(tmp_path / "a", *overrides)
    second, _ = train(tmp_path / "b", *overrides)
    assert first["train_losses"] == second["train_losses"]  # bitwise: same seed, same machine
    if os.environ.get("DSRUN_UPDATE_CURVES") == "1":
        CURVE.write_text(json.dumps({"overrides": overrides, "train_losses": first["train_losses"]}, indent=2) + "\n")
    stored = json.loads(CURVE.read_text())
    assert stored["overrides"] == overrides
    assert first["train_losses"] == pytest.approx(stored["train_losses"], rel=1e-5, abs=0), (
        "the default recipe's loss curve moved; if that is intended, regenerate the asset (see module docstring)")


def test_train_failure_exits_non_zero_and_names_the_rank(tmp_path):
    # a model key the GPT does not know fails inside every rank, after the launch
    result = run_cli("train", "+model.not_a_key=1", *SHORT, f"launcher.master_port={free_port()}", cwd=tmp_path,
                     timeout=300)
    assert result.returncode != 0
    assert "not_a_key" in result.stdout + result.stderr


def test_activation_checkpointing_mode_and_section_act_through_dsrun_train(tmp_path):
    """model.activation_checkpointing picks the blocks; the ds section reaches dsrun.checkpointing in every
    rank (profile prints each checkpoint's times) and is written to ds_config.json for DeepSpeed. (This short
    real launch also pins dsrun train's stage lines: composing, checking, starting the ranks, in that order.)"""
    result = run_cli("train", "model.activation_checkpointing=every_2", "+activation_checkpointing.profile=true",
                     *SHORT, "train.max_steps=1", f"launcher.master_port={free_port()}", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stages = [line.split(":")[0].split(" (")[0].split(";")[0] for line in result.stdout.splitlines()
              if line.startswith("[dsrun] ")]
    assert [line for line in stages if not line.startswith(("[dsrun] run directory", "[dsrun] note"))][:3] == [
        "[dsrun] composing the config", "[dsrun] checking before launch", "[dsrun] starting 2 rank(s) on localhost"
    ], result.stdout
    (run_dir,) = tmp_path.glob("outputs/*/*")
    # gpt-nano has 3 blocks: every_2 checkpoints blocks 0 and 2, numbered 0 and 1 in the forward
    lines = [line.split("activation checkpoint ")[1].split(" ")[:2] for line in result.stdout.splitlines()
             if "activation checkpoint" in line]
    assert lines == [["0:", "forward"], ["1:", "forward"], ["1:", "recompute"], ["0:", "recompute"]]
    written = json.loads((run_dir / "ds_config.json").read_text())
    assert written["activation_checkpointing"] == {"profile": True}
