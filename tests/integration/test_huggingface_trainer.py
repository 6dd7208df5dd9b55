"""Hugging Face's Trainer and accelerate's DeepSpeed plugin drive dsrun as their DeepSpeed, through ``dsrun launch
--as-deepspeed`` on 2 CPU ranks. The Trainer: an unedited HF script (``deepspeed=`` config with "auto" values),
ZeRO-2 and ZeRO-3, saving every 2 steps; a second run resumed from the step-2 checkpoint repeats steps 3-4
exactly. accelerate: its own loop with a DeepSpeed plugin, ZeRO-3, ``save_state`` / ``load_state``. PEFT: LoRA
adapters on a frozen base at ZeRO-3, trained and saved by the Trainer."""
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


def _printed_once(result, tag: str):
    """The one ``tag {json}`` line; when it is missing or repeated, the run's exit code and output's end say why."""
    found = _printed(result, tag)
    assert len(found) == 1, (f"{len(found)} {tag} lines; exit code {result.returncode}\n--- stdout (end) ---\n"
                             f"{result.stdout[-4000:]}\n--- stderr (end) ---\n{result.stderr[-4000:]}")
    return found[0]


def test_zero3_arguments_first_builds_the_model_inside_zero_init(tmp_path):
    """Hugging Face's documented ZeRO-3 order: ``TrainingArguments(deepspeed=<stage 3>)`` first, then
    ``from_config``/``from_pretrained``, which transformers builds inside ``deepspeed.zero.Init`` (patching
    ``partition_parameters.zero_wrapper_for_fp_tensor_constructor`` on the way). Each rank holds half of every
    model after load; the from-config weights are initialised (GPT-2's std 0.02) and the pretrained ones loaded
    exactly through ``GatheredParameters`` (and ``resize_token_embeddings`` keeps the old rows; ``_init_weights`` gave
    the residual projections GPT-2's scaled std and every bias and norm the whole build's value); the Trainer
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
    init = _printed_once(result, "INIT")
    assert abs(init["wte_std"] - 0.02) < 0.002 and init["ln_weight_mean"] == 1.0
    # _init_weights reached the partitioned weights (transformers 5 runs it inside GatheredParameters after the
    # build): GPT-2's residual projections get std 0.02 / sqrt(2 * n_layer) = 0.01, not Conv1D's own 0.02 (the
    # sample std of 1024 draws is within 0.01 / sqrt(2 * 1024) = 2.2e-4 per sigma: 1e-3 is 4.5 sigma); every
    # constant it writes (biases, norms) equals the model built whole; the random draws come in another order
    assert abs(init["c_proj_std"] - 0.01) < 1e-3
    assert len(init["equals_whole"]) == 18 and all(name.endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"))
                                                   for name in init["equals_whole"])
    assert "LOADED True" in result.stdout and "RESIZED True" in result.stdout
    saved = _printed_once(result, "SAFETENSORS")
    assert saved["equal"] and "transformer.wte.weight" in saved["names"] and len(saved["names"]) == 28
    assert len(first) == 4 and first[-1] < first[0]
    resumed = _losses(run_cli(*launch, "4", str(out / "checkpoint-2"), cwd=tmp_path, timeout=300))
    assert resumed[-2:] == first[2:]


LORA_SCRIPT = Path(__file__).with_name("_hf_lora_script.py")


@pytest.mark.parametrize("order", ["model-first", "args-first"])
def test_peft_lora_under_zero3_trains_the_adapters_and_saves_them(tmp_path, order):
    """PEFT LoRA (rank 4 on GPT-2's attention projections) trained by the Trainer at ZeRO-3 on 2 CPU ranks, the
    base built whole before the arguments (the engine partitions it, 16-bit gather on save off) or inside
    ``zero.Init`` after them (gather on). The base stays bit-identical to the file it was loaded from, every
    ``lora_B`` moves off its zero init (DeepSpeed users' "lora_B stays zero"), the checkpoint's
    ``adapter_model.safetensors`` holds the 8 adapters equal to the trained ones gathered, and a fresh base with
    those adapters loaded gives the trained engine's logits. Resuming ``checkpoint-2`` into a fresh PEFT model whose
    adapters start elsewhere repeats steps 3-4 bit for bit and ends with the same adapters."""
    # 4 steps: HF's "auto" warmup (0 steps) becomes DeepSpeed's WarmupLR minimum of 2 steps at LR 0, the same in
    # DeepSpeed; the adapters move at steps 3 and 4 (after 2 steps every lora_B is still zero, rightly)
    result = run_cli("launch", "--as-deepspeed", "--num_procs", "2", "--no_local_rank", str(LORA_SCRIPT), order,
                     str(tmp_path / "out"), "4", cwd=tmp_path, timeout=300)
    assert len(_losses(result)) == 4
    frozen = _printed_once(result, "FROZEN")
    assert frozen == {"count": 28, "identical": True}  # every base tensor (the head is tied to the embedding)
    adapters = _printed_once(result, "ADAPTERS")
    modules = [f"base_model.model.transformer.h.{layer}.attn.{name}" for layer in (0, 1)
               for name in ("c_attn", "c_proj")]
    assert adapters["trainable"] == sorted(f"{m}.lora_{ab}.default.weight" for m in modules for ab in "AB")
    assert adapters["lora_B_count"] == 4 and adapters["lora_B_all_nonzero"]
    saved = _printed_once(result, "SAVED")
    assert saved["equal"] and saved["names"] == sorted(f"{m}.lora_{ab}.weight" for m in modules for ab in "AB")
    logits = _printed_once(result, "LOGITS")
    assert logits["max_abs_diff"] == 0.0  # the same weights through the same ops: the same bits
    assert logits["adapted_loss"] < logits["base_loss"]  # the adapters learned something over the 64 sequences
    resumed = _printed_once(result, "RESUMED")
    assert resumed["start_differs"]  # so equal results below mean the checkpoint's adapters were loaded
    assert resumed["losses"][-2:] == _losses(result)[2:] and resumed["adapters_equal"]
