"""A Hugging Face Trainer script as users write it for DeepSpeed, run unedited through ``dsrun launch
--as-deepspeed``: ``TrainingArguments(deepspeed=<config with "auto" values>)``, a small GPT-2 built from its
config. ``argv``: STAGE OUTPUT_DIR MAX_STEPS [RESUME_FROM]. Rank 0 prints ``LOSSES [...]`` (one per step)."""
import json
import os
import sys

import torch
from transformers import GPT2LMHeadModel, Trainer

from _hf_data import Sequences, auto_ds_config, tiny_gpt2_config, training_arguments

stage, output_dir, max_steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
resume_from = sys.argv[4] if len(sys.argv) > 4 else None

ds_config = auto_ds_config({"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3})
args = training_arguments(output_dir, max_steps, ds_config)
torch.manual_seed(0)
model = GPT2LMHeadModel(tiny_gpt2_config())
trainer = Trainer(model=model, args=args, train_dataset=Sequences())
trainer.train(resume_from_checkpoint=resume_from)
if int(os.environ.get("RANK", "0")) == 0:
    print("LOSSES", json.dumps([entry["loss"] for entry in trainer.state.log_history if "loss" in entry]))
