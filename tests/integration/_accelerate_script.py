"""An ``accelerate`` training loop with a DeepSpeed plugin, as users write it for DeepSpeed, run unedited through
``dsrun launch --as-deepspeed``: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))``,
``DummyOptim`` (the optimizer comes from the config), a small GPT-2 built from its config. It trains 2 steps,
``accelerator.save_state`` (DeepSpeed's checkpoint), trains steps 3-4, ``accelerator.load_state`` back to step 2
and trains steps 3-4 again on the same batches. ``argv``: STAGE OUTPUT_DIR. Rank 0 prints ``LOSSES [...]`` (the
4 steps, then the 2 repeated ones; means over ranks)."""
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DummyOptim
from transformers import GPT2LMHeadModel

from _hf_data import Sequences, tiny_gpt2_config

stage, output_dir = int(sys.argv[1]), sys.argv[2]
ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
             "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
torch.manual_seed(0)
model = GPT2LMHeadModel(tiny_gpt2_config())
loader = torch.utils.data.DataLoader(Sequences(), batch_size=4, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, DummyOptim(model.parameters()), loader)
batches = [batch for _, batch in zip(range(4), loader)]
losses = []


def train(steps):
    for batch in steps:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())


train(batches[:2])
accelerator.save_state(output_dir)
train(batches[2:])
accelerator.load_state(output_dir)
train(batches[2:])
if int(os.environ.get("RANK", "0")) == 0:
    print("ENGINE", type(model).__module__)
    print("LOSSES", json.dumps(losses))
