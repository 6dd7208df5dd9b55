"""Hugging Face's Trainer and accelerate's DeepSpeed plugin drive dsrun as their DeepSpeed, through ``dsrun launch
--as-deepspeed`` on 2 CPU ranks. The Trainer: an unedited HF script (``deepspeed=`` config with "auto" values),
ZeRO-2 and ZeRO-3, saving every 2 steps; a second run resumed from the step-2 checkpoint repeats steps 3-4
exactly. accelerate: its own loop with a DeepSpeed plugin, ZeRO-3, ``save_state`` / ``load_state``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli

SCRIPT = Path(__file__).with_name("_hf_trainer_script.py")


def _losses(result) -> list[float]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if "LOSSES" in line)
    return json.loads(line.split("LOSSES", 1)[1])


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_trains_saves_and_resumes_through_the_alias(tmp_path, stage):
    out = tmp_path / "out"
    launch = ("launch", "--as-deepspeed", "--num_procs", "2", "--no_local_rank", str(SCRIPT), str(stage))
    first = _losses(run_cli(*launch, str(out), "4", cwd=tmp_path, timeout=420))
    assert len(first) == 4 and first[-1] < first[0]  # the loss falls
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in (checkpoint / "global_step2").glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    if stage == 3:  # accelerate saved the gathered weights (stage3_gather_16bit_weights_on_model_save)
        assert (out / "checkpoint-4" / "model.safetensors").stat().st_size > 0
    resumed = _losses(run_cli(*launch, str(out), "4", str(checkpoint), cwd=tmp_path, timeout=420))
    # weights, Adam moments, scheduler, data position and RNG all restored: the same arithmetic on the
    # same inputs gives the same bits
    assert resumed[-2:] == first[2:]


ACCELERATE_SCRIPT = Path(__file__).with_name("_accelerate_script.py")


def test_accelerate_deepspeed_plugin_trains_saves_and_reloads(tmp_path):
    """accelerate's own loop with ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))``, ZeRO-3 on 2
    CPU ranks: the engine is dsrun's, the loss falls, ``save_state`` writes DeepSpeed's checkpoint and
    ``load_state`` back to step 2 repeats steps 3-4 bit for bit."""
    state = tmp_path / "state"
    result = run_cli("launch", "--as-deepspeed", "--num_procs", "2", "--no_local_rank", str(ACCELERATE_SCRIPT), "3",
                     str(state), cwd=tmp_path, timeout=420)
    losses = _losses(result)
    assert "ENGINE dsrun.engine.engine" in result.stdout
    assert len(losses) == 6 and losses[:4] == sorted(losses[:4], reverse=True)  # the loss falls every step
    assert losses[4:] == losses[2:4]
    assert (state / "latest").read_text().strip() == "pytorch_model"
    assert sorted(p.name for p in (state / "pytorch_model").glob("*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


ARGS_FIRST_SCRIPT = Path(__file__).with_name("_hf_zero3_args_first.py")


def _printed(result, tag: str):
    """Every ``tag {json}`` line the ranks printed, parsed."""
    return [json.loads(line.split(tag, 1)[1]) for line in result.stdout.splitlines() if f"]:{tag} " in line
            or line.startswith(f"{tag} ")]


def test_zero3_arguments_first_builds_the_model_inside_zero_init(tmp_path):
    """Hugging Face's documented ZeRO-3 order: ``TrainingArguments(deepspeed=<stage 3>)`` first, then
    ``from_config``/``from_pretrained``, which transformers builds inside ``deepspeed.zero.Init`` (patching
    ``partition_parameters.zero_wrapper_for_fp_tensor_constructor`` on the way). Each rank holds half of every
    model after load; the from-config weights are initialised (GPT-2's std 0.02) and the pretrained ones loaded
    exactly through ``GatheredParameters`` (and ``resize_token_embeddings`` keeps the old rows); the Trainer
    trains, writes a ``model.safetensors`` equal to the gathered weights (``stage3_gather_16bit_weights_on_model_save``)
    and resumes with the same next losses."""
    out = tmp_path / "out"
    launch = ("launch", "--as-deepspeed", "--num_procs", "2", "--no_local_rank", str(ARGS_FIRST_SCRIPT), str(out))
    result = run_cli(*launch, "4", cwd=tmp_path, timeout=300)
    first = _losses(result)
    partitions = sorted(_printed(result, "PARTITION"), key=lambda report: report["rank"])
    assert [report["rank"] for report in partitions] == [0, 1]
    for report in partitions:
        for built in ("from_config", "from_pretrained"):
            assert report[built]["local_bytes"] * 2 == report[built]["full_bytes"] > 0
    (init,) = _printed(result, "INIT")
    assert abs(init["wte_std"] - 0.02) < 0.002 and init["ln_weight_mean"] == 1.0
    assert "LOADED True" in result.stdout and "RESIZED True" in result.stdout
    (saved,) = _printed(result, "SAFETENSORS")
    assert saved["equal"] and "transformer.wte.weight" in saved["names"] and len(saved["names"]) == 28
    assert len(first) == 4 and first[-1] < first[0]
    resumed = _losses(run_cli(*launch, "4", str(out / "checkpoint-2"), cwd=tmp_path, timeout=300))
    assert resumed[-2:] == first[2:]
