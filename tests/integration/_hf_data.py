"""What the Hugging Face client scripts (``_hf_trainer_script.py``, ``_hf_zero3_args_first.py``,
``_hf_lora_script.py``, ``_accelerate_script.py``, and ``benchmarks/hf_cross_checkpoint.py``'s ranks) share: the data
set, the tiny GPT-2 they train and the Trainer's DeepSpeed config and arguments. They import it as a sibling module
(a script's own folder is first on ``sys.path``; the benchmark puts this folder there)."""
import torch
from transformers import GPT2Config, TrainingArguments


class Sequences(torch.utils.data.Dataset):
    """64 sequences whose next token is always the current one + 3 (mod 64): learnable in a few steps."""

    def __init__(self):
        self.tokens = (torch.arange(16)[None, :] * 3 + torch.arange(64)[:, None]) % 64

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def tiny_gpt2_config() -> GPT2Config:
    """A 2-layer width-32 GPT-2 over the 64 tokens, without dropout (runs compare losses exactly)."""
    return GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def auto_ds_config(zero_optimization: dict) -> dict:
    """The DeepSpeed config Hugging Face's docs show, every value the Trainer knows left ``"auto"``."""
    return {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero_optimization,
    }


def training_arguments(output_dir: str, max_steps: int, ds_config: dict) -> TrainingArguments:
    """Batch 4 per rank, LR 1e-2, a loss logged every step and a ``checkpoint-N`` every 2 steps, on the CPU."""
    return TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4, max_steps=max_steps,
                             learning_rate=1e-2, logging_steps=1, save_strategy="steps", save_steps=2, report_to=[],
                             deepspeed=ds_config, use_cpu=True, seed=0, disable_tqdm=True)
