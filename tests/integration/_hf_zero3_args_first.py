"""Hugging Face's documented ZeRO-3 order, run unedited through ``dsrun launch --as-deepspeed``:
``TrainingArguments(deepspeed=<stage-3 config>)`` first, then ``AutoModelForCausalLM.from_config`` /
``from_pretrained``, which transformers builds inside ``deepspeed.zero.Init`` (its weights initialised, or loaded,
through ``GatheredParameters``). ``argv``: OUTPUT_DIR MAX_STEPS [RESUME_FROM].

Each rank prints ``PARTITION {...}`` (the bytes it holds of each model after load); rank 0 prints ``INIT {...}``
(the gathered from-config weights), ``RESIZED`` (whether ``resize_token_embeddings`` kept the old rows),
``LOADED`` (whether from_pretrained's gathered weights equal the saved ones), ``SAFETENSORS`` (whether the last
checkpoint's ``model.safetensors`` equals the trained weights gathered) and ``LOSSES [...]``."""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, Trainer
from transformers.integrations import is_deepspeed_zero3_enabled

from _hf_data import Sequences, auto_ds_config, tiny_gpt2_config, training_arguments

output_dir, max_steps = sys.argv[1], int(sys.argv[2])
resume_from = sys.argv[3] if len(sys.argv) > 3 else None
rank = int(os.environ.get("RANK", "0"))
config = tiny_gpt2_config()

# a pretrained checkpoint to load, written before ZeRO-3 is switched on (each rank its own copy: no barrier needed)
pretrained_dir = os.path.join(output_dir, f"pretrained-rank{rank}")
torch.manual_seed(1)
pretrained = AutoModelForCausalLM.from_config(config)
pretrained.save_pretrained(pretrained_dir)
saved = {name: value.detach().clone() for name, value in pretrained.state_dict().items()}
del pretrained

# the same model built whole with the seed the ZeRO-3 build below uses (its _init_weights run on full tensors)
torch.manual_seed(0)
whole = {name: value.detach().clone() for name, value in AutoModelForCausalLM.from_config(config).named_parameters()}

ds_config = auto_ds_config({"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                            "stage3_param_persistence_threshold": 0})
# the arguments first: from here on transformers builds every model inside deepspeed.zero.Init
args = training_arguments(output_dir, max_steps, ds_config)
assert is_deepspeed_zero3_enabled()

import deepspeed  # noqa: E402  (the alias: the Trainer's arguments imported it already)


def partition_report(model):
    """What this rank holds of ``model``: its shard bytes, and the full bytes of every parameter."""
    params = list(model.parameters())
    assert all(hasattr(p, "ds_id") and p.ds_status.name == "NOT_AVAILABLE" and p.numel() == 0 for p in params)
    local = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params)
    full = sum(p.ds_numel * p.ds_tensor.element_size() for p in params)
    return {"local_bytes": local, "full_bytes": full}


def gathered(model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


torch.manual_seed(0)
initialised = AutoModelForCausalLM.from_config(config)
init_report = partition_report(initialised)
init_weights = gathered(initialised)
# resize_token_embeddings gathers the old table to copy it into the new one (which, as in DeepSpeed, is built whole
# and partitioned by the engine)
initialised.resize_token_embeddings(72)
with deepspeed.zero.GatheredParameters([initialised.transformer.wte.weight]):
    resized = initialised.transformer.wte.weight.detach().clone()
del initialised

model = AutoModelForCausalLM.from_pretrained(pretrained_dir)
load_report = partition_report(model)
loaded = gathered(model)
print("PARTITION", json.dumps({"rank": rank, "from_config": init_report, "from_pretrained": load_report}),
      flush=True)
if rank == 0:
    wte = init_weights["transformer.wte.weight"]
    print("INIT", json.dumps({"wte_std": wte.std().item(), "ln_weight_mean": init_weights[
        "transformer.ln_f.weight"].mean().item(), "tied": init_weights.keys() == loaded.keys(),
        "c_proj_std": init_weights["transformer.h.0.attn.c_proj.weight"].std().item(),
        "equals_whole": sorted(name for name in whole if torch.equal(whole[name], init_weights[name]))}), flush=True)
    print("RESIZED", resized.shape == (72, 32) and torch.equal(resized[:64], wte), flush=True)
    print("LOADED", all(torch.equal(loaded[name], saved[name]) for name in loaded), flush=True)

trainer = Trainer(model=model, args=args, train_dataset=Sequences())
trainer.train(resume_from_checkpoint=resume_from)
trained = gathered(model)
if rank == 0:
    from safetensors.torch import load_file

    written = load_file(os.path.join(output_dir, f"checkpoint-{max_steps}", "model.safetensors"))
    print("SAFETENSORS", json.dumps({"names": sorted(written), "equal": all(
        torch.equal(written[name], trained[name]) for name in written)}), flush=True)
    print("LOSSES", json.dumps([entry["loss"] for entry in trainer.state.log_history if "loss" in entry]))
