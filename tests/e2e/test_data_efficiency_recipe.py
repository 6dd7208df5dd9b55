"""The data_efficiency options compose and validate, and `dsrun train +recipe=gpt_data_efficiency` trains with
the curriculum (analysed in the run directory) and random-LTD, reporting the tokens and layer-tokens it used."""
from __future__ import annotations

import json

import pytest

from dsrun.compose import compose_runspec
from dsrun.runspec import resolve_run
from tests.helpers import run_cli

OPTIONS = ("none", "curriculum_seqlen", "sampling_seqlen", "sampling_rarity", "random_ltd", "pld", "all")


@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_composes_and_validates_on_the_recipe(option):
    run = resolve_run(compose_runspec(["+recipe=gpt_data_efficiency", f"data_efficiency={option}"]))
    ds = run.ds
    assert ds.curriculum_learning.enabled == (option == "curriculum_seqlen")
    assert ds.progressive_layer_drop.enabled == (option == "pld")
    assert ds.data_efficiency.data_routing.random_ltd.enabled == (option in ("random_ltd", "all"))
    metrics = ds.data_efficiency.data_sampling.curriculum_learning.curriculum_metrics or {}
    assert ("seqlen" in metrics) == (option in ("sampling_seqlen", "all"))
    assert ("vocabularyrarity" in metrics) == (option in ("sampling_rarity", "all"))


@pytest.mark.slow
def test_recipe_trains_with_curriculum_and_random_ltd(tmp_path):
    result = run_cli("train", "+recipe=gpt_data_efficiency", "train.max_steps=6", "train.eval_interval=3",
                     "train.eval_iters=1", "train.save_interval=3", "data.max_bytes=300000", "monitor=csv",
                     cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (run_dir,) = tmp_path.glob("outputs/*/*")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    last = metrics["eval_losses"][-1]
    full = 6 * metrics["train_batch_size"] * 128
    # the seqlen curriculum starts at 16 of 128 tokens (random-LTD keeps 16 too, so it drops nothing yet)
    assert last["tokens"] == 6 * metrics["train_batch_size"] * 16 < full and last["layer_tokens"] == 8 * last["tokens"]
    assert metrics["random_ltd_consumed_layer_tokens"] > 0
    assert (run_dir / "data_analysis" / "vocabularyrarity" / "vocabularyrarity_index_to_sample.idx").is_file()
    assert any((run_dir / "data_clusters").iterdir())
    (tmp_path / "again").mkdir()
    resumed = run_cli("train", "+recipe=gpt_data_efficiency", "train.max_steps=6", "train.eval_interval=3",
                      "train.eval_iters=1", "data.max_bytes=300000", "monitor=csv",
                      f"train.resume={run_dir / 'checkpoints' / 'global_step3'}", cwd=tmp_path / "again", timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    (again,) = (tmp_path / "again").glob("outputs/*/*")
    repeat = json.loads((again / "metrics.json").read_text())
    assert repeat["train_losses"] == metrics["train_losses"][3:]  # the same batches and token drops after resume
