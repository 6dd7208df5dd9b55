"""A Hugging Face Trainer script as users write it for DeepSpeed, run unedited through ``dsrun launch
--as-deepspeed``: ``TrainingArguments(deepspeed=<config with "auto" values>)``, a small GPT-2 built from its
config. ``argv``: STAGE OUTPUT_DIR MAX_STEPS [RESUME_FROM]. Rank 0 prints ``LOSSES [...]`` (one per step)."""
import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from _hf_data import Sequences

stage, output_dir, max_steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
resume_from = sys.argv[4] if len(sys.argv) > 4 else None

ds_config = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": stage == 3},
}


args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4, max_steps=max_steps,
                         learning_rate=1e-2, logging_steps=1, save_strategy="steps", save_steps=2, report_to=[],
                         deepspeed=ds_config, use_cpu=True, seed=0, disable_tqdm=True)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   bos_token_id=0, eos_token_id=0))
trainer = Trainer(model=model, args=args, train_dataset=Sequences())
trainer.train(resume_from_checkpoint=resume_from)
if int(os.environ.get("RANK", "0")) == 0:
    print("LOSSES", json.dumps([entry["loss"] for entry in trainer.state.log_history if "loss" in entry]))
