"""PEFT LoRA under ZeRO-3 with Hugging Face's Trainer, run unedited through ``dsrun launch --as-deepspeed``: the tiny
GPT-2 of ``_hf_data.py`` wrapped by ``get_peft_model`` (LoRA of rank 4 on the attention projections, GPT-2's
``Conv1D`` modules ``attn.c_attn`` and ``attn.c_proj``), trained at stage 3. ``argv``: ORDER OUTPUT_DIR MAX_STEPS.

ORDER ``model-first`` builds the base whole and wraps it before ``TrainingArguments`` (the engine partitions base and
adapters alike), with ``stage3_gather_16bit_weights_on_model_save`` off (the Trainer's PEFT save gathers the adapters
through ``engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)`` by itself). ORDER
``args-first`` is Hugging Face's ZeRO-3 order: the arguments first, so ``from_pretrained`` builds the base inside
``deepspeed.zero.Init`` (partitioned before PEFT adds its whole adapters), with the gather flag on.

Rank 0 prints ``FROZEN {...}`` (the base, gathered after training, against the file it was loaded from),
``ADAPTERS {...}`` (the trainable names and whether every gathered ``lora_B`` moved off zero), ``SAVED {...}`` (the
last checkpoint's ``adapter_model.safetensors`` against the gathered trained adapters), ``LOGITS {...}`` (a fresh
base with the saved adapters loaded against the trained engine's logits, and the loss over the 64 sequences of
the base alone and with the adapters) and ``LOSSES [...]``.

Then every rank resumes ``checkpoint-2`` in a second Trainer (as ``trainer.train(resume_from_checkpoint=...)`` after
a restart does: the Trainer loads DeepSpeed's checkpoint without the frozen base, ``load_module_strict=False``)
into a fresh PEFT model whose adapters start elsewhere (another seed), and rank 0 prints ``RESUMED {...}``: whether
the fresh ``lora_A`` differed from the saved one, the resumed run's losses and whether its trained adapters equal
the first run's."""
import json
import os
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, Trainer

from _hf_data import Sequences, auto_ds_config, tiny_gpt2_config, training_arguments

order, output_dir, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
assert order in ("model-first", "args-first"), order
rank = int(os.environ.get("RANK", "0"))
config = tiny_gpt2_config()
LORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["attn.c_attn", "attn.c_proj"],
                  fan_in_fan_out=True)  # GPT-2's Conv1D stores its weight (in, out)

# the pretrained base, written before ZeRO-3 is switched on (each rank its own copy: no barrier needed)
base_dir = os.path.join(output_dir, f"base-rank{rank}")
torch.manual_seed(1)
AutoModelForCausalLM.from_config(config).save_pretrained(base_dir)
base_file = load_file(os.path.join(base_dir, "model.safetensors"))

ds_config = auto_ds_config({"stage": 3, "stage3_gather_16bit_weights_on_model_save": order == "args-first",
                            "stage3_param_persistence_threshold": 0})


def peft_model_and_arguments(seed: int, out: str):
    torch.manual_seed(seed)  # the adapters' lora_A initialisation
    if order == "model-first":
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LORA)
        return model, training_arguments(out, max_steps, ds_config)
    args = training_arguments(out, max_steps, ds_config)
    base = AutoModelForCausalLM.from_pretrained(base_dir)  # inside deepspeed.zero.Init: each rank holds its half
    assert all(p.numel() == 0 and hasattr(p, "ds_id") for p in base.parameters())
    return get_peft_model(base, LORA), args


model, args = peft_model_and_arguments(0, output_dir)

import deepspeed  # noqa: E402  (the alias: the Trainer's arguments imported it already)


def gathered(module):
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {name: p.detach().clone() for name, p in module.named_parameters()}


def base_name(name: str) -> str:
    """The base file's key of a wrapped base parameter (``base_model.model.X.base_layer.weight`` is ``X.weight``)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


trainer = Trainer(model=model, args=args, train_dataset=Sequences())
trainer.train()
trained = gathered(model)
trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
sample = Sequences().tokens[:4]
trainer.model_wrapped.eval()
with torch.no_grad():  # every rank: the engine gathers the partitioned weights for the forward
    trained_logits = trainer.model_wrapped(input_ids=sample).logits

if rank == 0:
    frozen = {name: value for name, value in trained.items() if "lora_" not in name}
    print("FROZEN", json.dumps({"count": len(frozen), "identical": all(
        torch.equal(value, base_file[base_name(name)]) for name, value in frozen.items())}), flush=True)
    lora_b = [value for name, value in trained.items() if "lora_B" in name]
    print("ADAPTERS", json.dumps({"trainable": trainable, "lora_B_count": len(lora_b),
                                  "lora_B_all_nonzero": all(bool(value.abs().sum() > 0) for value in lora_b)}),
          flush=True)
    checkpoint = os.path.join(output_dir, f"checkpoint-{max_steps}")
    saved = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))
    print("SAVED", json.dumps({"names": sorted(saved), "equal": all(
        torch.equal(value, trained[name.replace(".weight", ".default.weight")]) for name, value in saved.items())}),
        flush=True)
    fresh = GPT2LMHeadModel(config).eval()  # a plain constructor: not built inside zero.Init
    fresh.load_state_dict(base_file, strict=False)  # lm_head.weight is tied to the embedding, not in the file
    everything = Sequences().tokens
    with torch.no_grad():
        base_loss = fresh(input_ids=everything, labels=everything).loss.item()
        reloaded = PeftModel.from_pretrained(fresh, checkpoint).eval()  # injects the adapters into ``fresh``
        reloaded_logits = reloaded(input_ids=sample).logits
        adapted_loss = reloaded(input_ids=everything, labels=everything).loss.item()
    print("LOGITS", json.dumps({"max_abs_diff": (reloaded_logits - trained_logits).abs().max().item(),
                                "base_loss": base_loss, "adapted_loss": adapted_loss}), flush=True)
    print("LOSSES", json.dumps([entry["loss"] for entry in trainer.state.log_history if "loss" in entry]))

# a restart resuming checkpoint-2: its adapters, Adam moments, step, scheduler, data position and RNG
fresh_model, fresh_args = peft_model_and_arguments(1234, os.path.join(output_dir, "resumed"))
start = gathered(fresh_model)  # the adapters are whole until the engine partitions them
resumed = Trainer(model=fresh_model, args=fresh_args, train_dataset=Sequences())
resumed.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-2"))
after_resume = gathered(fresh_model)
if rank == 0:
    first_saved = load_file(os.path.join(output_dir, "checkpoint-2", "adapter_model.safetensors"))
    print("RESUMED", json.dumps({
        "start_differs": any(not torch.equal(start[name.replace(".weight", ".default.weight")], value)
                             for name, value in first_saved.items() if "lora_A" in name),
        "losses": [entry["loss"] for entry in resumed.state.log_history if "loss" in entry],
        "adapters_equal": all(torch.equal(after_resume[name], value) for name, value in trained.items()
                              if "lora_" in name)}), flush=True)
